"""Training steps through the backend: CUDA-graph replay of forward, backward and optimizer graphs.

Why. A training step of a compiled conv net launches hundreds of kernels per pass; on an
H100 its host time is much of the step (bench/RESULTS.md, "Training"). Replaying CUDA graphs
cuts that, but a training step has more state than an inference call: autograd saves
activations for the backward, the backward's gradients flow into ``.grad``, an optimizer
writes the parameters in place, dropout draws random numbers. Inductor's CUDA-graph trees
(``mode="reduce-overhead"``) already handle all of it: a forward and its backward share one
memory pool, parameters and buffers are static inputs (replays write them where they are;
a parameter that moves is re-recorded), random draws go through graph-safe Philox offsets
(each replay advances the generator as a plain call does: on an H100, six dropout training
steps gave the same losses replayed and plain, ``bench/training.py --rng-check``),
and gradients that autograd accumulates are copied out of the pool (they are "cached
tensors", which ``AccumulateGrad`` never steals). So the backend reuses that machinery for
training graphs, with one change that keeps plain-call semantics: Inductor's outputs live in
the pool and are overwritten by the next replay, so :class:`PlainOutputs` clones every
output the caller sees that is not a view of an input (those AOTAutograd rebuilds outside
the graph). Holding the loss or the logits of step *n* while step *n+1* runs is then as safe
as without CUDA graphs.

Opt-in (``training_cuda_graphs=True``): a GPU test of a model-only compile (forward compiled,
``backward`` outside, gradients accumulating over steps) met the trees' "overwritten by a
subsequent run" error in a later backward; whole-step compiles ran (bench/RESULTS.md,
"Training"). The backend also refuses graphs of FSDP-managed modules, whose parameters FSDP
re-allocates every step.

Which graphs. :func:`training_route` says whether a graph belongs to this path: a graph
autograd records (training), or one run without autograd that writes parameters or
buffers in place (an optimizer's update). :func:`refusal` says why replaying one could
differ from running it as is, from the op-facts model alone: anything but static-shape CUDA
tensor inputs, collectives (every rank must issue them as it would unreplayed), ops the
model does not know, and writes into inputs that are not parameters or buffers (Inductor would copy them into the graph and
the caller's tensor would never see the write). A refused graph runs Inductor's code with
plain launches, and ``CompiledGraph.no_replay`` says why; so does a graph whose replay
Inductor itself gives up (its ``cudagraph_skips``), caught from Inductor's log.

Not covered: ``torch.autograd.grad`` returns the backward graph's outputs themselves, which
live in the pool; Inductor marks them so that reading one after a later replay overwrote it
raises an error rather than returning stale values. ``.backward()`` is unaffected.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from fxopt.analysis import ops
from fxopt.analysis.alias import storages_of, traced_value, written_storages

__all__ = ["PlainOutputs", "inductor_skips", "refusal", "training_route"]


def training_route(gm: fx.GraphModule, *, training: bool,
                   is_state: Callable[[fx.Node], bool]) -> bool:
    """Whether ``gm`` belongs to a training step: autograd records it, or it writes
    parameters or buffers (``is_state`` of a placeholder) in place, as an optimizer does."""
    if training:
        return True
    state = [n for n in gm.graph.find_nodes(op="placeholder") if is_state(n)]
    state += list(gm.graph.find_nodes(op="get_attr"))
    written = written_storages(gm.graph)
    if written is None:  # a write into something unknown: take it for state, never inference
        return True
    return any(storages_of(traced_value(n)) & written for n in state if traced_value(n) is not None)


def refusal(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
            is_state: Callable[[fx.Node], bool]) -> str | None:
    """Why replaying the training-path graph ``gm`` through Inductor's CUDA-graph trees
    could differ from running it (None: it cannot). ``is_state`` says which placeholders
    are parameters or buffers (static addresses that Inductor writes where they are)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    caller_owned = set().union(*(storages_of(traced_value(n)) for n in placeholders if not is_state(n)))
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        facts = ops.facts(node)
        if facts.collective:
            return f"node {node.name} is a collective ({facts.reason})"
        if facts.unknown:
            return f"node {node.name} is not known to the op-facts model ({facts.reason})"
        for written in facts.writes:
            if traced_value(written) is None or storages_of(traced_value(written)) & caller_owned:
                return f"node {node.name} writes input {written.name}, which is not a parameter or buffer"
        for leaf in tree_flatten(traced_value(node))[0]:
            if isinstance(leaf, torch.SymInt | torch.SymFloat | torch.SymBool) or (
                    isinstance(leaf, torch.Tensor) and any(not isinstance(s, int) for s in leaf.shape)):
                return f"node {node.name} has a dynamic shape"
    seen: set = set()  # outputs are cloned apart, which would break their aliasing
    for index, out in enumerate(tree_flatten(gm.graph.output_node().args[0])[0]):
        storages = storages_of(traced_value(out)) if isinstance(out, fx.Node) else set()
        if storages & seen:
            return f"output {index} shares storage with another output"
        seen |= storages
    for index, value in enumerate(example_inputs):
        if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
            return f"input {index} is a symbolic size (dynamic shapes)"
        if isinstance(value, torch.Tensor) and value.device.type != "cuda":
            return f"input {index} is on {value.device}"
    return None


def fresh_outputs(gm: fx.GraphModule) -> list[bool]:
    """For each flat output of ``gm``: whether it is a tensor of the graph's own (not a view
    of an input), i.e. one that Inductor's replay leaves in its memory pool."""
    inputs = set().union(set(), *(storages_of(traced_value(n)) for n in gm.graph.find_nodes(op="placeholder")))
    inputs |= set().union(set(), *(storages_of(traced_value(n)) for n in gm.graph.find_nodes(op="get_attr")))
    flags = []
    for out in tree_flatten(gm.graph.output_node().args[0])[0]:
        value = traced_value(out) if isinstance(out, fx.Node) else out
        flags.append(isinstance(value, torch.Tensor) and not (storages_of(value) & inputs))
    return flags


class PlainOutputs:
    """A compiled graph whose outputs the caller owns: each output in ``fresh`` is cloned
    out of Inductor's CUDA-graph pool (autograd records the clone, so gradients flow)."""

    def __init__(self, compiled: Callable, fresh: Sequence[bool]):
        self.compiled = compiled
        self.fresh = list(fresh)

    def __call__(self, *args: Any) -> Any:
        outputs = self.compiled(*args)
        if not isinstance(outputs, list | tuple):
            return outputs.clone() if self.fresh and self.fresh[0] else outputs
        cloned = [o.clone() if fresh and isinstance(o, torch.Tensor) else o
                  for o, fresh in zip(outputs, self.fresh)]
        cloned += list(outputs[len(cloned):])
        return type(outputs)(cloned) if isinstance(outputs, tuple) else cloned


class _SkipCatcher(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def inductor_skips() -> Iterator[list[str]]:
    """The reasons Inductor gives, while the block runs, for not replaying a graph it was
    asked to (``log_cudagraph_skip_and_bump_counter``)."""
    from torch._inductor import cudagraph_utils

    catcher = _SkipCatcher()
    log = cudagraph_utils.cudagraphs_log
    log.addHandler(catcher)
    try:
        yield catcher.messages
    finally:
        log.removeHandler(catcher)
