"""``assert_equivalent``: does a rewritten graph compute what the original computes?

The check runs the original (the *reference*) and the rewrite on clones of the same
inputs under the same RNG seed and compares every output with per-dtype tolerances
(:mod:`fxopt.numerics`), and also compares the inputs afterwards, since a rewrite that
starts writing into an input changes the caller's data even when the outputs agree.

Three refinements keep it both sensitive and free of false alarms:

* the reference runs twice; if it disagrees with itself, comparing against it means
  nothing and :class:`~fxopt.errors.NondeterministicReferenceError` is raised;
* half-precision outputs (float16, bfloat16) are judged against the original re-run in
  float64 (parameters, buffers, constants and inputs converted): per element, the
  rewrite may be a few times as far from the float64 result as the original is, no more
  (:mod:`fxopt.numerics`). And when the rewrite holds no new floating constants (those
  carry their own rounding), it is run in float64 too and must agree with the original to
  float32 precision: a changed op that rounding hides in half precision (relu against
  ``leaky_relu(0.001)``, a LayerNorm epsilon) shows there. Both float64 runs must stay in
  float64/float32 throughout (a graph that casts to half precision itself skips the
  exact check). In float32, outputs that miss the fixed tolerance still pass when they
  are as close to the float64 result as the original's;
* on failure both graphs are replayed node by node, nodes are paired through
  provenance (:func:`fxopt.provenance.origins`), and the first node of the rewrite
  whose value departs from its partner's is named in the error.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from fxopt.compile.seeding import seeded
from fxopt.errors import (
    EquivalenceError,
    NondeterministicReferenceError,
    ReferenceFailureError,
    StructureMismatchError,
)
from fxopt.numerics import Mismatch, compare, exact_mismatch, is_low_precision
from fxopt.provenance import PROVENANCE_KEY, origins
from fxopt.testing.inputs import random_inputs

Model = nn.Module | Callable[..., Any]


def assert_equivalent(
    before: Model,
    after: Model,
    inputs: Sequence[Any] | None = None,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
    float64_reference: bool = True,
    check_determinism: bool = True,
    check_inputs: bool = True,
    localize: bool = True,
) -> None:
    """Raise :class:`~fxopt.errors.EquivalenceError` unless ``after`` computes what
    ``before`` computes on ``inputs``.

    ``inputs`` defaults to fresh random inputs drawn from ``before``'s placeholders
    (``meta['val']``; see :func:`fxopt.testing.inputs.random_inputs`). Without ``rtol``
    and ``atol``, float32/float64 outputs use :data:`fxopt.numerics.DEFAULT_TOLERANCES`
    (fp32 1e-4; integers exact) and float16/bfloat16 outputs are judged against the
    float64 reference (module doc; ``docs/soundness.md``). Given, they set a fixed
    ``allclose`` tolerance for every dtype (a float output that misses it still passes
    when its RMS error against float64 is within 3x the original's). A ``before`` that raises, or
    that disagrees with itself on a second run, raises
    :class:`~fxopt.errors.ReferenceFailureError` instead: nothing was compared.
    """
    if inputs is None:
        if not isinstance(before, fx.GraphModule):
            raise TypeError("assert_equivalent needs inputs=(...) unless `before` is a GraphModule "
                            "whose placeholders carry meta['val']")
        inputs = random_inputs(before, seed=seed)
    inputs = tuple(inputs)
    expected, expected_inputs = _run_reference(before, inputs, seed)
    if check_determinism:
        again, _ = _run_reference(before, inputs, seed)
        drift = compare(expected, again, rtol, atol)
        if drift is not None:
            raise NondeterministicReferenceError(
                f"the reference gives different results on two runs with the same inputs and "
                f"seed ({drift}); make it deterministic (seed random ops, avoid nondeterministic "
                f"kernels) before comparing a rewrite against it")
    try:
        actual, actual_inputs = _run(after, inputs, seed)
    except Exception as exc:
        raise EquivalenceError(f"the rewritten graph raises {type(exc).__name__}: {exc}") from exc

    half = float64_reference and rtol is None and atol is None and any(
        is_low_precision(t.dtype) for t in _tensors(expected))
    mismatch = None if half else compare(expected, actual, rtol, atol)
    if half or mismatch is not None and not mismatch.structural and float64_reference:
        reference, pure = _float64_reference(before, inputs, seed, expected)
        if reference is not None:
            mismatch = compare(expected, actual, rtol, atol, reference=reference)
        elif half:
            mismatch = compare(expected, actual, rtol, atol)
        if half and mismatch is None and reference is not None and pure:
            mismatch = _exact_arithmetic_mismatch(before, after, inputs, seed, reference)
    if mismatch is None and check_inputs:
        mismatch = compare(expected_inputs, actual_inputs, rtol, atol, path="input")
        if mismatch is not None:
            mismatch = Mismatch(_input_path(before, mismatch.path),
                                f"the rewrite leaves this input different: {mismatch.message}",
                                mismatch.structural)
    if mismatch is None:
        return
    divergence = None
    localize = localize and not mismatch.structural and not mismatch.path.startswith("input") \
        and isinstance(before, fx.GraphModule) and isinstance(after, fx.GraphModule)
    if localize:
        divergence = first_divergence(before, after, inputs, rtol=rtol, atol=atol, seed=seed)
    lines = [f"the rewritten graph is not equivalent to the original: {mismatch}"]
    if divergence is not None:
        lines.append(str(divergence))
    elif localize and mismatch.against_reference:
        lines.append("no node differs from its original beyond the fixed tolerance of its dtype; "
                     "the difference shows only against the float64 reference")
    elif localize:
        lines.append("no node paired with the original (by provenance or name) diverges; "
                     "the difference arises in nodes the rewrite created without provenance")
    error = StructureMismatchError if mismatch.structural else EquivalenceError
    raise error("\n".join(lines), mismatch=mismatch,
                diverging_node=divergence.after_node if divergence else None)


def _input_path(model: Model, path: str) -> str:
    """``input[1]...`` -> ``input 'y'...`` when the model is a graph with named inputs."""
    if isinstance(model, fx.GraphModule) and path.startswith("input["):
        index, _, rest = path[len("input["):].partition("]")
        names = [n.name for n in model.graph.nodes if n.op == "placeholder"]
        if index.isdigit() and int(index) < len(names):
            return f"input {names[int(index)]!r}{rest}"
    return path


def _clone(value: Any) -> Any:
    return tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, value)


def _run(model: Model, inputs: tuple[Any, ...], seed: int) -> tuple[Any, tuple[Any, ...]]:
    """Outputs of ``model`` on clones of ``inputs``, and those clones afterwards."""
    args = _clone(inputs)
    with seeded(model, seed), torch.no_grad():
        out = model(*args)
    return _clone(out), args


def _run_reference(model: Model, inputs: tuple[Any, ...], seed: int) -> tuple[Any, tuple[Any, ...]]:
    try:
        return _run(model, inputs, seed)
    except Exception as exc:
        raise ReferenceFailureError(
            f"the reference (the graph before the rewrite) raises {type(exc).__name__}: {exc}; "
            "nothing was compared: check the inputs and the original graph") from exc


def _float64_reference(model: Model, inputs: tuple[Any, ...], seed: int, expected: Any) -> tuple[Any, bool]:
    """``model``'s outputs computed in float64 (None where the model does not allow it: it
    mixes dtypes, or gives a differently shaped result), and whether the run stayed in
    float64/float32 throughout."""
    low = [x for x in _tensors(inputs) + _tensors(model) if x.is_floating_point() and x.dtype != torch.float64]
    if not low:
        return None, False  # nothing to widen: the run would repeat the original
    reference, pure = _run_float64(model, inputs, seed)
    if reference is None:
        return None, False
    same_shapes = compare(
        tree_map(lambda t: t.shape if isinstance(t, torch.Tensor) else None, expected),
        tree_map(lambda t: t.shape if isinstance(t, torch.Tensor) else None, reference))
    return (reference, pure) if same_shapes is None else (None, False)


def _run_float64(model: Model, inputs: tuple[Any, ...], seed: int) -> tuple[Any, bool]:
    spy = _HalfPrecisionSpy()
    try:
        wide, wide_inputs = to_float64(model), tree_map(_widen, inputs)
        with spy:
            out, _ = _run(wide, wide_inputs, seed)
    except Exception:
        return None, False
    return out, not spy.seen


class _HalfPrecisionSpy(TorchDispatchMode):
    """Notes whether any op produced a half-precision tensor (an explicit cast)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.seen:
            self.seen = any(isinstance(t, torch.Tensor) and is_low_precision(t.dtype)
                            for t in torch.utils._pytree.tree_leaves(out))
        return out


def _exact_arithmetic_mismatch(before: Model, after: Model, inputs: tuple[Any, ...], seed: int,
                               reference: Any) -> Mismatch | None:
    """The rewrite run in float64 against the original run in float64 (see the module doc);
    None when the rewrite holds new floating constants or casts to half precision itself."""
    if _new_float_constants(before, after):
        return None
    rewritten, pure = _run_float64(after, inputs, seed)
    if rewritten is None or not pure:
        return None
    return exact_mismatch(reference, rewritten)


def _new_float_constants(before: Model, after: Model) -> bool:
    """Whether ``after`` holds floating tensors that ``before`` does not (folded weights)."""
    old = [t for t in _tensors(before) if t.is_floating_point()]
    ids = {id(t) for t in old}
    for t in _tensors(after):
        if not t.is_floating_point() or id(t) in ids:
            continue
        if not any(o.shape == t.shape and o.dtype == t.dtype and torch.equal(o, t) for o in old):
            return True
    return False


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, nn.Module):
        found = [t for m in obj.modules() for t in (*m._parameters.values(), *m._buffers.values(),
                                                    *vars(m).values()) if isinstance(t, torch.Tensor)]
        return found
    return [t for t in torch.utils._pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _widen(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().to(torch.float64)
    return x


def to_float64(model: Model) -> Model:
    """A float64 copy of ``model``: parameters, buffers and plain tensor attributes."""
    if not isinstance(model, nn.Module):
        return model
    wide = copy.deepcopy(model).to(torch.float64)
    for module in wide.modules():
        for key, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                setattr(module, key, value.to(torch.float64))
    if isinstance(wide, fx.GraphModule):
        wide.recompile()
    return wide


# --- localization ---------------------------------------------------------------------


@dataclass
class Divergence:
    """The first node of the rewrite whose value departs from its original counterpart."""

    after_node: str
    before_node: str
    mismatch: Mismatch
    after_repr: str
    before_repr: str
    created_by: str | None = None
    #: nodes feeding ``after_node`` that pair with nothing in the original (new, or
    #: changed in place without provenance): where the difference most likely starts
    unpaired_inputs: tuple[str, ...] = ()
    #: True when the values agreed when computed and differ only at the end of the run:
    #: an in-place write reached the value in one graph and not in the other
    written_later: bool = False

    def __str__(self) -> str:
        by = f" (created by pass {self.created_by!r})" if self.created_by else ""
        when = (" (equal when computed, different at the end of the run: an in-place write "
                "reaches it in one graph only)" if self.written_later else "")
        text = (f"first diverging node: {self.after_node!r}{by} in the rewrite, paired with "
                f"{self.before_node!r} in the original{when}: {self.mismatch.message}\n"
                f"  rewrite:  {self.after_repr}\n  original: {self.before_repr}")
        if self.unpaired_inputs:
            text += ("\n  it is fed by nodes with no counterpart in the original (new, or changed "
                     "without provenance): " + "\n    ".join(["", *self.unpaired_inputs]))
        return text


class _Recorder(fx.Interpreter):
    """Runs a graph and keeps a copy of every node's value (copies: later in-place ops
    must not change what was recorded)."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.values: dict[str, Any] = {}
        self.live: dict[str, Any] = {}  # the values themselves: their state at the end

    def run_node(self, node: fx.Node) -> Any:
        result = super().run_node(node)
        if node.op != "output":
            self.values[node.name] = _clone(result)
            self.live[node.name] = result
        return result


def _record(gm: fx.GraphModule, inputs: tuple[Any, ...], seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every node's value when computed, and at the end of the run."""
    recorder = _Recorder(gm)
    try:
        with seeded(gm, seed), torch.no_grad():
            recorder.run(*_clone(inputs))
    except Exception:
        pass  # what was recorded up to the failure still localizes
    return recorder.values, _clone(recorder.live)


def pair_nodes(before: fx.GraphModule, after: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Map each node of ``after`` to the node of ``before`` whose value it should equal.

    A node that a pass created stands for the *last* (in the original's order) of the
    nodes it replaces: a fused conv+BN computes what the BN computed. A node with no
    provenance pairs with the same-named original node if that computes the same op.
    """
    order = {n.name: (i, n) for i, n in enumerate(before.graph.nodes)}
    pairs: dict[fx.Node, fx.Node] = {}
    for node in after.graph.nodes:
        if node.op == "output":
            continue
        found = sorted(order[name] for name in origins(node) if name in order)
        if not found:
            continue
        partner = found[-1][1]
        if PROVENANCE_KEY not in node.meta and (partner.op, partner.target) != (node.op, node.target):
            continue  # a same-named but unrelated node
        pairs[node] = partner
    return pairs


def first_divergence(before: fx.GraphModule, after: fx.GraphModule, inputs: Sequence[Any], *,
                     rtol: float | None = None, atol: float | None = None,
                     seed: int = 0) -> Divergence | None:
    """The first node (in the rewrite's order) whose value differs from its partner's."""
    inputs = tuple(inputs)
    before_values, before_final = _record(before, inputs, seed)
    after_values, after_final = _record(after, inputs, seed)
    pairs = pair_nodes(before, after)
    for written_later, (old, new) in enumerate([(before_values, after_values), (before_final, after_final)]):
        for node, partner in pairs.items():
            if node.name not in new or partner.name not in old:
                continue
            mismatch = compare(old[partner.name], new[node.name], rtol, atol, path=node.name)
            if mismatch is not None:
                unpaired = tuple(n.format_node() or n.name for n in _unpaired_ancestors(node, pairs))
                return Divergence(node.name, partner.name, mismatch, node.format_node() or node.name,
                                  partner.format_node() or partner.name, node.meta.get("fxopt.created_by"),
                                  unpaired, bool(written_later))
    return None


def _unpaired_ancestors(node: fx.Node, pairs: dict[fx.Node, fx.Node]) -> list[fx.Node]:
    """Unpaired nodes reachable from ``node``'s inputs without crossing a paired node."""
    found: list[fx.Node] = []
    stack = list(node.all_input_nodes)
    seen: set[fx.Node] = set()
    while stack:
        current = stack.pop()
        if current in seen or current in pairs or current.op == "placeholder":
            continue
        seen.add(current)
        found.append(current)
        stack.extend(current.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(found, key=order.__getitem__)
