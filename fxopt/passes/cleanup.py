"""Cleanup passes: dce, cse, constant_fold, remove_dropout, eliminate_identity.

All of them consult :mod:`fxopt.analysis.ops`, which is what makes them sound where
torch's own helpers are not: ``Graph.eliminate_dead_code()`` drops the unused results of
``x.add_()``, ``torch.relu_``, ``+=`` and ``nn.ReLU(inplace=True)``; ours keeps them,
and CSE never merges random ops or computations separated by an in-place write.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxopt.analysis.ops import is_barrier, is_pure, is_random, mutated_inputs
from fxopt.errors import AnalysisError
from fxopt.graph_utils import (
    downstream,
    drop_unused_attributes,
    fetch_attr,
    fresh_attr_name,
    upstream,
)
from fxopt.pass_protocol import Option, Pass, PassResult
from fxopt.provenance import PROVENANCE_KEY, origins, record_replacement
from fxopt.registry import register_pass


def replace_node(node: fx.Node, replacement: fx.Node, pass_name: str) -> None:
    """Point every user of ``node`` at ``replacement``, note provenance, erase ``node``."""
    node.replace_all_uses_with(replacement)
    # an existing replacement goes on standing for itself as well (a dropout's input, a CSE
    # survivor); without this its own name would drop out of every later node's origins
    replacement.meta.setdefault(PROVENANCE_KEY, origins(replacement))
    record_replacement(replacement, [node], pass_name)
    node.graph.erase_node(node)


@register_pass
class DeadCodeElimination(Pass):
    """Remove unused nodes that have no side effects (in-place and random ops are kept)."""

    name = "dce"
    needs_fake_values = False
    preserves = ("shapes",)

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        removed = 0
        for node in reversed(gm.graph.nodes):
            if not node.users and is_pure(node):
                gm.graph.erase_node(node)
                removed += 1
        return PassResult(removed > 0, {"removed": removed})


def _hashable(value: Any) -> Any:
    """A hashable key for an argument that never equates values torch treats differently
    (``1``, ``1.0`` and ``True``; ``0.0`` and ``-0.0``)."""
    if isinstance(value, fx.Node):
        return value
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_hashable(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", _hashable(value.start), _hashable(value.stop), _hashable(value.step))
    if isinstance(value, float):
        return ("float", repr(value))
    if isinstance(value, (bool, int, complex, str)) or value is None:
        return (type(value).__name__, value)
    return ("obj", id(value))  # tensors, modules, dtypes...: identity


@register_pass
class CommonSubexpressionElimination(Pass):
    """Merge identical pure computations; never random ops, and never across a barrier.

    Merging moves the later computation up to the earlier one, so it obeys the same rule
    as any move: no write, collective, unknown op (Dynamo's ``_set_grad_enabled``: the
    twins run under different grad modes) or stateful op may lie between the twins.
    """

    name = "cse"
    needs_fake_values = False
    # no preserves: a merged twin's users and their views keep values in the twin's storage,
    # so the storages the alias analysis reads would be stale (inplace would write a live one)

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        seen: dict[Any, fx.Node] = {}
        merged = 0
        written = _possibly_written(gm, ctx)
        for node in list(gm.graph.nodes):
            if is_barrier(node):
                # a write may change what an earlier expression would compute now; an
                # unknown op may change the mode it runs in
                seen.clear()
                continue
            if node.op not in ("call_function", "call_method", "call_module", "get_attr") or not is_pure(node):
                continue
            if node in written:
                continue  # its result is written in place later: a merged twin would see the write
            key = (node.op, _hashable(node.target), _hashable(node.args), _hashable(dict(node.kwargs)))
            twin = seen.get(key)
            if twin is None:
                seen[key] = node
            else:
                replace_node(node, twin, self.name)
                merged += 1
        return PassResult(merged > 0, {"merged": merged})


def _possibly_written(gm: fx.GraphModule, ctx: Any) -> set[fx.Node]:
    """Nodes whose result may share a storage with a tensor that some node writes in place.

    Storage facts come from the alias analysis; without shapes to run it, every node a
    written value was computed from or feeds is taken to share its storage (coarser, still
    sound).
    """
    targets = {t for n in gm.graph.nodes for t in mutated_inputs(n)}
    if not targets:
        return set()
    try:
        alias = ctx.analysis("alias")
    except AnalysisError:
        return set(targets) | upstream(targets) | downstream(targets)
    written = set().union(*alias.writes.values())
    return {n for n, storages in alias.storages.items() if storages & written}


@register_pass
class ConstantFold(Pass):
    """Evaluate subgraphs that depend only on parameters and constants, storing buffers;
    the get_attr nodes and attributes nothing reads any more are dropped."""

    name = "constant_fold"
    needs_fake_values = False
    inference_only = True  # parameters become constants: gradients no longer reach them
    options: ClassVar = {
        "max_bytes": Option(int, 64 << 20, "skip folded results larger than this many bytes"),
    }

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        # a value that the graph writes in place (or a view of one) is not a constant: folded
        # into a buffer, the write would change the buffer and every later call with it
        written = _possibly_written(gm, ctx)
        constant = {n for n in gm.graph.nodes
                    if self._is_constant_source(gm, n) and n not in written}
        for node in gm.graph.nodes:
            if (node.op in ("call_function", "call_method", "call_module") and is_pure(node)
                    and node not in written and all(i in constant for i in node.all_input_nodes)):
                constant.add(node)
        frontier = [n for n in gm.graph.nodes
                    if n in constant and n.op != "get_attr" and any(u not in constant for u in n.users)]
        if not frontier:
            return PassResult(False, {"folded": 0})
        values = self._evaluate(gm, constant)
        sources = self._source_storages(gm, constant)
        held: set[int] = set()
        folded, too_large, views = 0, 0, 0
        for node in frontier:
            value = values[node]
            if not isinstance(value, torch.Tensor):
                continue
            if value.numel() * value.element_size() > self.options["max_bytes"]:
                too_large += 1
                continue
            storage = _storage_key(value)
            if storage is not None and storage in sources:
                # a view of an attribute (`w.t()`, `.to` of its own dtype) computes nothing:
                # folding it would only copy the weight
                views += 1
                continue
            # a result that is its whole storage becomes the buffer as it is; one that shares
            # a storage with an earlier folded value, or holds only part of its storage (a
            # slice of a larger temporary, which would keep all of it alive), is copied
            whole = value.untyped_storage().nbytes() == value.numel() * value.element_size()
            if storage is None or storage in held or not whole:
                value = value.clone()
            else:
                held.add(storage)
            attr = fresh_attr_name(gm, f"_folded_{node.name}")
            gm.register_buffer(attr, value.detach())
            with gm.graph.inserting_before(node):
                getter = gm.graph.get_attr(attr)
            getter.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta")})
            replace_node(node, getter, self.name)
            folded += 1
        for node in reversed(gm.graph.nodes):
            if node in constant and not node.users and node.op != "get_attr":
                gm.graph.erase_node(node)
        dropped = drop_unused_attributes(gm)  # the folded-away weights: not carried twice
        return PassResult(folded > 0 or bool(dropped),
                          {"folded": folded, "too_large": too_large, "views_kept": views,
                           "dropped": len(dropped)})

    @staticmethod
    def _is_constant_source(gm: fx.GraphModule, node: fx.Node) -> bool:
        if node.op != "get_attr":
            return False
        try:
            return isinstance(fetch_attr(gm, node.target), torch.Tensor)
        except AttributeError:
            return False

    @staticmethod
    def _source_storages(gm: fx.GraphModule, constant: set[fx.Node]) -> set[int]:
        """The storages of the tensors the constant subgraph starts from: its attributes and
        the state of the modules it calls. A pure op returns new tensors or views of its
        inputs, so these are the only existing storages a result can share."""
        tensors: list[Any] = []
        for node in constant:
            if node.op == "get_attr":
                tensors.append(fetch_attr(gm, node.target))
            elif node.op == "call_module":
                module = gm.get_submodule(node.target)
                tensors += [*module.parameters(), *module.buffers()]
        return {key for t in tensors if isinstance(t, torch.Tensor) and (key := _storage_key(t)) is not None}

    @staticmethod
    def _evaluate(gm: fx.GraphModule, constant: set[fx.Node]) -> dict[fx.Node, Any]:
        interpreter = fx.Interpreter(gm)
        values: dict[fx.Node, Any] = {}
        with torch.no_grad():
            for node in gm.graph.nodes:
                if node in constant:
                    interpreter.env = values
                    values[node] = interpreter.run_node(node)
        return values


def _storage_key(t: torch.Tensor) -> int | None:
    """Where ``t``'s data lives (None for a tensor without a plain storage: always copied)."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return ptr or None


_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                    nn.FeatureAlphaDropout)
_DROPOUT_FUNCTIONS = {
    F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
    torch.dropout, torch.alpha_dropout, torch.feature_alpha_dropout, torch.feature_dropout,
    torch.ops.aten.dropout.default, torch.ops.aten.feature_dropout.default,
    torch.ops.aten.alpha_dropout.default, torch.ops.aten.feature_alpha_dropout.default,
}


@register_pass
class RemoveDropout(Pass):
    """Remove dropout that is switched off (eval-mode modules, functional training=False)."""

    name = "remove_dropout"
    needs_fake_values = False
    preserves = ("shapes",)

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        removed = 0
        for node in list(gm.graph.nodes):
            if self._is_disabled_dropout(gm, node):
                source = node.args[0] if node.args else node.kwargs["input"]
                replace_node(node, source, self.name)
                removed += 1
        return PassResult(removed > 0, {"removed": removed})

    @staticmethod
    def _is_disabled_dropout(gm: fx.GraphModule, node: fx.Node) -> bool:
        if node.op == "call_module":
            return isinstance(gm.get_submodule(node.target), _DROPOUT_MODULES) and not is_random(node)
        if node.op == "call_function":
            try:
                known = node.target in _DROPOUT_FUNCTIONS
            except TypeError:
                return False
            return known and not is_random(node) and _training_flag(node) is False
        return False


def _training_flag(node: fx.Node) -> bool | None:
    """The explicit training/train flag of a dropout call (F.dropout defaults to True)."""
    for key in ("training", "train"):
        if key in node.kwargs:
            return node.kwargs[key]
    if len(node.args) > 2:
        return node.args[2]
    return True


# --- identity elimination -----------------------------------------------------------

_CAST_METHODS = frozenset({"float", "double", "half", "bfloat16", "int", "long", "bool",
                           "to", "type", "type_as"})
_VIEW_TARGETS = {"view", "reshape", "expand", torch.reshape,
                 torch.ops.aten.view.default, torch.ops.aten.reshape.default,
                 torch.ops.aten.expand.default, torch.ops.aten._unsafe_view.default}
_ALIAS_TARGETS = {torch.ops.aten.alias.default}


@register_pass
class EliminateIdentity(Pass):
    """Remove no-ops: nn.Identity, same-dtype casts, contiguous() of contiguous tensors,
    views/reshapes/expands/permutes that keep the shape."""

    name = "eliminate_identity"
    needs_fake_values = False
    preserves = ("shapes",)

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        try:
            ctx.analysis("shapes")
            have_shapes = True
        except AnalysisError:
            have_shapes = False  # only the shape-free rules apply
        removed = 0
        for node in list(gm.graph.nodes):
            source = self._identity_source(gm, node, have_shapes)
            if source is not None:
                replace_node(node, source, self.name)
                removed += 1
        stats: dict[str, Any] = {"removed": removed}
        if not have_shapes:
            stats["shape_rules"] = "skipped: no shapes (pass example_inputs)"
        return PassResult(removed > 0, stats)

    @staticmethod
    def _identity_source(gm: fx.GraphModule, node: fx.Node, have_shapes: bool) -> fx.Node | None:
        """The input that ``node`` returns unchanged (or a view of, with equal shape)."""
        if node.op == "call_module":
            return node.args[0] if isinstance(gm.get_submodule(node.target), nn.Identity) else None
        if node.op not in ("call_function", "call_method") or not node.args:
            return None
        source = node.args[0]
        if not isinstance(source, fx.Node):
            return None
        target = node.target
        try:
            if target in _ALIAS_TARGETS:
                return source
        except TypeError:
            return None
        if not have_shapes:
            return None
        out, inp = node.meta.get("val"), source.meta.get("val")
        if not (isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor)):
            return None
        if out.shape != inp.shape or out.dtype != inp.dtype or out.device != inp.device:
            return None
        if node.op == "call_method" and target in _CAST_METHODS:
            # Tensor.to/float/... return `self` (not a copy) when dtype, device and layout stay
            keeps_layout = out.stride() == inp.stride() and not node.kwargs.get("copy", False)
            return source if keeps_layout else None
        if target in ("contiguous", torch.ops.aten.contiguous.default):
            return source if inp.is_contiguous() else None
        if target in ("permute", torch.permute, torch.ops.aten.permute.default):
            dims = node.args[1:] if node.op == "call_method" and len(node.args) > 2 else node.args[1]
            return source if list(dims) == list(range(inp.dim())) else None
        if target in ("transpose", torch.transpose, torch.ops.aten.transpose.int):
            return source if len(node.args) == 3 and _same_dim(node.args[1], node.args[2], inp.dim()) else None
        if target in _VIEW_TARGETS:
            return source if out.stride() == inp.stride() else None
        return None


def _same_dim(a: Any, b: Any, rank: int) -> bool:
    return isinstance(a, int) and isinstance(b, int) and a % max(rank, 1) == b % max(rank, 1)

