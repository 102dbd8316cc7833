"""Training steps through the backend: CUDA-graph replay of forward, backward and optimizer graphs.

Why. A training step of a compiled conv net launches hundreds of kernels per pass; on an
H100 its host time is much of the step (bench/RESULTS.md, "Training"). Replaying CUDA graphs
cuts that, but a training step has more state than an inference call: autograd saves
activations for the backward, the backward's gradients flow into ``.grad``, an optimizer
writes the parameters in place, dropout draws random numbers. Inductor's CUDA-graph trees
(``mode="reduce-overhead"``) already handle all of it: a forward and its backward share one
memory pool, parameters and buffers are static inputs (replays write them where they are;
a parameter that moves is re-recorded), random draws go through graph-safe Philox offsets
(each replay advances the generator as a plain call does). So the backend reuses that
machinery for training graphs, by default, with what keeps plain-call semantics around it
(:class:`PlainOutputs`):

- Outputs live in the pool and the next replay overwrites them: every output the caller
  sees that is not a view of an input is cloned out, so a loss or logits kept from step *n*
  are intact after step *n+1* (under ``reduce-overhead`` they are overwritten).
- Gradients live in the pool too. ``torch.autograd.grad`` returns them: copied out.
  ``AccumulateGrad`` steals one into ``.grad`` when ``.grad`` is None; the usual loop drops
  it (``zero_grad()``) before the next step, so nothing is copied, but a ``.grad`` still
  held when a later generation of the trees starts (accumulation,
  ``zero_grad(set_to_none=False)``) is copied out of the pool first. Before, such loops met
  the trees' "overwritten by a subsequent run" error, and training replay was opt-in.
- Weights frozen into inference graphs (an evaluation under ``no_grad`` between steps)
  are watched by :class:`fxopt.compile.freezing.FrozenWeights`: once a step changed them, that
  graph runs with its weights as inputs.

The backend also refuses graphs of FSDP-managed modules, whose parameters FSDP
re-allocates every step.

Which graphs. :func:`training_route` says whether a graph belongs to this path: a graph
autograd records (training), or one run without autograd that writes parameters or
buffers in place (an optimizer's update). :func:`refusal` says why replaying one could
differ from running it as is, from the op-facts model alone: anything but CUDA tensor
inputs, collectives (every rank must issue them as it would unreplayed), ops the model does
not know, and writes into inputs that are not parameters or buffers (Inductor would copy
them into the graph and the caller's tensor would never see the write). Shapes that vary
(the last, smaller batch of an epoch) are recorded once per shape, as the trees do. A
refused graph runs Inductor's code with plain launches, and ``CompiledGraph.no_replay``
says why; so does a graph whose replay Inductor itself gives up (its ``cudagraph_skips``),
caught from Inductor's log. ``retain_graph=True`` behaves as under plain ``torch.compile``
(it raises AOTAutograd's donated-buffer error where the compiled backward came from its
cache).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

# at import, not on first use: the first use is inside an autograd hook during a backward,
# and importing Inductor's module there left torch 2.11's garbage collector to crash later
# (reproduced on the CPU: a compiled MLP's backward, then gc.collect())
from torch._inductor.cudagraph_trees import CUDAGraphTreeManager
from torch.autograd.function import BackwardCFunction
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
    seen: set = set()  # outputs are cloned apart, which would break their aliasing
    for index, out in enumerate(tree_flatten(gm.graph.output_node().args[0])[0]):
        storages = storages_of(traced_value(out)) if isinstance(out, fx.Node) else set()
        if storages & seen:
            return f"output {index} shares storage with another output"
        seen |= storages
    for index, value in enumerate(example_inputs):
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


class _PendingGrads:
    """Gradients that ``AccumulateGrad`` stole out of a replayed backward's pool into
    ``.grad``, with the generation of the CUDA-graph trees they belong to: the first replay
    of a later generation may reuse their memory, so :meth:`PlainOutputs.__call__` copies
    those still held before it runs. One for the process, behind a lock, not one per
    thread: the autograd engine runs a CUDA backward on a thread of its own."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.generation: int | None = None
        #: each leaf a backward handed a gradient to (weakly: a model the caller dropped, and
        #: the gradients in its pool, are not kept alive here, nor copied by a later model's
        #: call), with the address of that gradient
        self.grads: list[tuple[weakref.ref[torch.Tensor], int]] = []


_PENDING = _PendingGrads()


def _generation() -> int:
    """The CUDA-graph trees' current generation (a new one starts with each new
    ``torch.compile`` invocation, or at ``torch.compiler.cudagraph_mark_step_begin``)."""
    return CUDAGraphTreeManager.get_curr_generation()


#: a leaf that the cloned outputs of every replayed graph also take (:class:`_ClonedOut`), so
#: that its accumulator is in the graph of every backward through them: the engine runs it
#: in a ``.backward()`` without ``inputs=``, and never in ``torch.autograd.grad`` (or under
#: ``inputs=``), which runs only what leads to what it returns
_ANCHOR = torch.zeros((), requires_grad=True)
#: held here so that every graph meets this one accumulator (a leaf keeps its own weakly)
_ANCHOR_NODE = torch.autograd.graph.get_gradient_edge(_ANCHOR).node


# never traced: a backward inside a compiled frame (on the CPU, or reentrant) would otherwise
# have Dynamo compile this hook, with the engine queries as graph calls
@torch.compiler.disable
def _grads_out_of_pool(grad_inputs: tuple[torch.Tensor | None, ...], _: Any) -> tuple | None:
    """A hook on a replayed graph's backward node: keeps the input gradients it computes
    (in its CUDA-graph pool, where a later replay overwrites them) from reaching the caller
    in the pool. ``torch.autograd.grad`` returns them to the caller: copied here.
    ``.backward()`` hands a leaf's gradient to ``AccumulateGrad``, which adds it into
    ``.grad`` at once or, when ``.grad`` is None, steals it: no copy here (the common loop
    drops ``.grad`` before the next step), but the stolen ones are noted and copied out before
    a later generation replays (:class:`_PendingGrads`).

    Why a hook on the node rather than an autograd Function that every trained input passes
    through: such a Function made an autograd view of each input on every call, 2.5-3 us per
    input and step on a 2-core CPU, about 0.45 ms a step at resnet50's count of parameters;
    the hook is registered once per call, whatever the count (bench/host_cost.py;
    bench/RESULTS.md, "Host cost per call (issue 29)")."""
    if not torch._C._will_engine_execute_node(_ANCHOR_NODE):
        return tuple(None if g is None else g.clone() for g in grad_inputs)
    handed = []
    for (node, _), grad in zip(torch._C._current_autograd_node().next_functions, grad_inputs):
        leaf = getattr(node, "variable", None)  # AccumulateGrad's
        if leaf is not None and grad is not None:
            handed.append((weakref.ref(leaf), grad.data_ptr()))
    generation = _generation()
    with _PENDING.lock:
        if _PENDING.generation != generation:
            _PENDING.generation, _PENDING.grads = generation, []
        _PENDING.grads += handed
    return None


class _ClonedOut(torch.autograd.Function):
    """Copies of a replayed graph's outputs (out of its pool), as one autograd node that
    also takes :data:`_ANCHOR`; gradients pass through unchanged."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)  # an output the loss never used gets no zeros made for it
        return tuple(o.clone() for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return (None, *grads)


def _backward_node(outputs: Iterable[torch.Tensor]) -> torch.autograd.graph.Node | None:
    """The autograd node of the compiled graph (AOTAutograd's ``CompiledFunction``) that
    made ``outputs``: an output's own node, or, for a view of one of the graph's
    intermediates that AOTAutograd regenerated, the node its view nodes lead back to."""
    for out in outputs:
        node = out.grad_fn
        while node is not None and not isinstance(node, BackwardCFunction):
            edges = node.next_functions
            node = edges[0][0] if edges else None
        if node is not None:
            return node
    return None


def _copy_stolen_grads() -> None:
    """Copy out of the pool every ``.grad`` that still holds a gradient stolen from an
    earlier generation's backward: the replay about to run may overwrite it."""
    if not _PENDING.grads or _PENDING.generation == _generation():
        return
    with _PENDING.lock:
        pending, _PENDING.grads = _PENDING.grads, []
    with torch.no_grad():
        for ref, pointer in pending:
            leaf = ref()
            grad = None if leaf is None else leaf.grad
            if grad is not None and grad.data_ptr() == pointer:
                leaf.grad = grad.clone()


class PlainOutputs:
    """A compiled training graph replayed by Inductor's CUDA-graph trees, with plain-call
    semantics: each output in ``fresh`` is cloned out of the pool (through
    :class:`_ClonedOut` where autograd records it, so gradients flow), and the gradients its
    backward computes for the inputs never reach the caller in the pool (a hook,
    :func:`_grads_out_of_pool`, on the graph's backward node)."""

    def __init__(self, compiled: Callable, fresh: Sequence[bool]):
        self.compiled = compiled
        self.fresh = list(fresh)

    def __call__(self, *args: Any) -> Any:
        _copy_stolen_grads()
        outputs = self.compiled(*args)
        single = not isinstance(outputs, list | tuple)
        flat = [outputs] if single else list(outputs)
        fresh = [i for i, (o, f) in enumerate(zip(flat, self.fresh)) if f and isinstance(o, torch.Tensor)]
        trained = [i for i in fresh if flat[i].requires_grad]  # none where autograd is off
        if trained:
            node = _backward_node(flat[i] for i in trained)
            if node is not None:  # None: no gradient of the graph's inputs flows back through it
                node.register_hook(_grads_out_of_pool)
            for i, copy in zip(trained, _ClonedOut.apply(_ANCHOR, *(flat[i] for i in trained))):
                flat[i] = copy
        for i in fresh:
            if i not in trained:
                flat[i] = flat[i].clone()
        if single:
            return flat[0]
        return type(outputs)(flat) if isinstance(outputs, tuple) else flat


class _SkipCatcher(logging.Handler):
    """Collects the records of the thread that installed it: a compile in another thread
    logs to the same logger meanwhile."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.thread = threading.get_ident()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread:
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
