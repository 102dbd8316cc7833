"""Cheap snapshots of a GraphModule, for rollback and for before/after diffs.

Copying a graph with ``Graph.graph_copy`` costs about as much as a cheap pass, which
would make transactions expensive. Instead a snapshot records, per node, the immutable
pieces fx keeps anyway (op, target, args, kwargs, name, type) plus a shallow copy of
``meta`` — O(n) tuple building, no node creation. Only a rollback (rare) or a diff
(on demand) pays for rebuilding a graph from the records.

Module state is snapshotted as shallow copies of every submodule's ``__dict__`` (and of
``gm.meta``). Tensor *data* is guarded by :class:`TensorGuard`: passes create new tensors
rather than writing into existing ones, and the guard checks that they did, whatever the
route of the write (autograd-visible in-place ops, ``.data``, ``p.data = ...``, a
``.numpy()`` view), and puts the data back when one did.

A snapshot kept in a report is plain data once copied or pickled (``__deepcopy__`` /
``__reduce__``): node references become names, so copying an optimized GraphModule
never walks the linked list of an old graph's nodes.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

# Node fields a rebuild needs. They are read column by column with attrgetter/map, so the
# per-node work stays in C and a snapshot allocates no per-node objects besides metadata
# copies: this runs before every pass, and allocations here feed Python's cyclic GC, whose
# full collections over a large graph cost more than the snapshot itself.
_FIELDS = ("op", "target", "_args", "_kwargs", "name", "type")
_META = operator.attrgetter("meta")
_NO_META: dict = {}


def _copy_meta(meta: dict) -> dict:
    return meta.copy() if meta else _NO_META


@dataclass
class GraphSnapshot:
    """The structure of a graph at one moment; can rebuild an equal graph later."""

    #: the live nodes (None in a copied or unpickled snapshot, whose args refer to names)
    nodes: list[fx.Node] | None
    #: one list per entry of _FIELDS, aligned with ``nodes``
    columns: tuple[list[Any], ...]
    metas: list[dict]
    codegen: Any
    tracer_cls: Any
    tracer_extras: Any

    @classmethod
    def take(cls, graph: fx.Graph) -> GraphSnapshot:
        nodes = list(graph.nodes)
        return cls(
            nodes=nodes,
            columns=tuple(list(map(operator.attrgetter(f), nodes)) for f in _FIELDS),
            metas=list(map(_copy_meta, map(_META, nodes))),
            codegen=graph._codegen,
            tracer_cls=getattr(graph, "_tracer_cls", None),
            tracer_extras=getattr(graph, "_tracer_extras", None),
        )

    def __len__(self) -> int:
        return len(self.metas)

    def restore_meta(self) -> None:
        """Put back every recorded node's metadata (the nodes themselves are unchanged)."""
        assert self.nodes is not None, "only a live snapshot can restore metadata"
        for node, meta in zip(self.nodes, self.metas):
            node.meta = dict(meta)

    def build(self, owning_module: fx.GraphModule | None = None) -> fx.Graph:
        """A new graph with the recorded nodes, names and metadata."""
        graph = fx.Graph(owning_module, self.tracer_cls, self.tracer_extras)
        graph._codegen = self.codegen
        env: dict[str, fx.Node] = {}

        def lookup(value: Any) -> Any:
            if isinstance(value, fx.Node):
                return env[value.name]
            return env[str(value)] if isinstance(value, _NodeName) else value

        for op, target, args, kwargs, name, type_, meta in zip(*self.columns, self.metas):
            new = graph.create_node(op, target, fx.node.map_aggregate(args, lookup),
                                    fx.node.map_aggregate(kwargs, lookup), name=name, type_expr=type_)
            new.meta = dict(meta)
            env[name] = new
        return graph

    def to_graph_module(self, root: torch.nn.Module) -> fx.GraphModule:
        """A GraphModule over ``root``'s attributes with the recorded graph (for diffs).

        ``root`` must hold every attribute the recorded graph names: passes delete the
        weights they fold away (:func:`fxopt.graph_utils.drop_unused_attributes`), so an
        early snapshot rebuilds over the model given to the run, not over its result."""
        return fx.GraphModule(root, self.build())

    def _plain_columns(self) -> tuple[list[Any], ...]:
        def name_of(value: Any) -> Any:
            return _NodeName(value.name) if isinstance(value, fx.Node) else value

        return tuple(
            [fx.node.map_aggregate(v, name_of) for v in column] if field in ("_args", "_kwargs") else list(column)
            for field, column in zip(_FIELDS, self.columns))

    def __deepcopy__(self, memo: dict[int, Any]) -> GraphSnapshot:
        # node references become names; metadata is shared, as fx's own graph copy does
        return GraphSnapshot(None, self._plain_columns(), [dict(m) for m in self.metas],
                             self.codegen, self.tracer_cls, self.tracer_extras)

    def __reduce__(self) -> tuple[Any, ...]:
        # metadata keeps only plain values: FakeTensors and the like cannot be pickled
        metas = [{k: v for k, v in m.items() if _is_plain(v)} for m in self.metas]
        return (GraphSnapshot, (None, self._plain_columns(), metas, self.codegen, None, None))


class _NodeName(str):
    """A reference to a node by name, in a snapshot detached from its graph."""


_PLAIN_LEAVES = (str, int, float, bool, type(None), torch.dtype, torch.device)  # not memory_format: protocol 2 (torch.save) cannot pickle it


def _is_plain(value: Any) -> bool:
    if isinstance(value, _PLAIN_LEAVES):
        return True
    if isinstance(value, (tuple, list)):
        return all(map(_is_plain, value))
    if isinstance(value, dict):
        return all(_is_plain(k) and _is_plain(v) for k, v in value.items())
    return False


class ModuleState:
    """Shallow copies of every submodule's attributes (and of ``gm.meta``)."""

    def __init__(self, gm: fx.GraphModule):
        self.dicts = [(m, _copy_module_dict(m.__dict__)) for m in gm.modules()]

    def restore(self) -> None:
        for module, saved in self.dicts:
            module.__dict__.clear()
            module.__dict__.update(_copy_module_dict(saved))


_MODULE_CONTAINERS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "meta")


def _copy_module_dict(d: dict) -> dict:
    """``d`` with its containers of tensors, children and metadata copied (``.copy()``:
    this runs for every module before every pass)."""
    out = d.copy()
    for key in _MODULE_CONTAINERS:
        value = out.get(key)
        if isinstance(value, (dict, set)):
            out[key] = value.copy()
    return out


def _tensors(gm: fx.GraphModule):
    """Every tensor the module tree holds: parameters, buffers and plain attributes."""
    for prefix, module in gm.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for key, value in module.__dict__.items():
            if isinstance(value, torch.Tensor):
                yield dot + key, value
        for key, value in {**module._parameters, **module._buffers}.items():
            if value is not None:
                yield dot + key, value


@dataclass
class _Guarded:
    name: str
    tensor: torch.Tensor
    #: an alias of the tensor's data as it was (``p.data = other`` swaps it out)
    data: torch.Tensor
    #: where the data lives: storage, offset, shape, strides of every plain tensor inside
    layout: tuple
    version: int
    #: a copy of the contents (None when over the backup limit, or kept by ``batch``)
    copy: torch.Tensor | None
    #: the batch that compares its contents with others' and holds its backup (None:
    #: compared on its own, backed up in ``copy``), and its position there
    batch: _Batch | None = None
    index: int = -1

    def backup(self) -> torch.Tensor | None:
        """The copy of the contents as they were (None when over the backup limit)."""
        return self.batch.copy_of(self.index) if self.batch is not None else self.copy


class TensorGuard:
    """Detects and undoes writes into the tensors a GraphModule held, by any route.

    Every tensor held when the run starts (the user's parameters and buffers, since the
    result of ``optimize`` shares them) and every tensor a pass adds later is recorded with
    its storage, its version counter and a copy of its contents. After each pass,
    :meth:`changed` finds the tensors whose storage was swapped (``p.data = ...``) or whose
    contents differ from the copy (writes through ``.data`` or a ``.numpy()`` view bypass
    version counters, so contents decide); :meth:`restore` puts them back. Tensor
    subclasses (DTensor) are compared through the plain tensors they wrap. The content
    comparison is bytewise (a NaN equals itself).

    Small dense CPU tensors (an LLM graph has thousands: norms' weights, biases) are
    compared in batches (:class:`_Batch`): one concatenation and one comparison per batch
    instead of one Python call per tensor, which made the guard most of a cheap pass's cost.

    Copies are skipped above ``limit_bytes`` (then only swaps and version changes are
    detected, and contents cannot be restored; the manager says so).
    """

    def __init__(self, gm: fx.GraphModule, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.entries: dict[int, _Guarded] = {}
        self.batches: list[_Batch] = []
        self.total = 0
        self.track(gm)

    def track(self, gm: fx.GraphModule) -> None:
        """Start guarding the tensors ``gm`` holds that are not guarded yet."""
        new = [(name, t) for name, t in _tensors(gm) if id(t) not in self.entries]
        new = list({id(t): (name, t) for name, t in new}.values())
        self.total += sum(t.numel() * t.element_size() for _, t in new)
        copying = self.total <= self.limit_bytes
        batched: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        with torch.no_grad():
            for name, t in new:
                if copying and _batchable(t):
                    batched.setdefault(_SAME_SIZE_INT[t.element_size()], []).append((name, t))
                    continue
                copy = _backup(t) if copying else None
                self.entries[id(t)] = _Guarded(name, t, t.data, _layout(t), _version(t), copy)
            for as_int, group in batched.items():
                batch = _Batch(as_int, [t for _, t in group])
                self.batches.append(batch)
                for index, (name, t) in enumerate(group):
                    self.entries[id(t)] = _Guarded(name, t, t.data, _layout(t), _version(t), None, batch, index)

    def changed(self) -> list[str]:
        """Names of the guarded tensors that were written or swapped since recorded."""
        suspects = {id(e.tensor) for b in self.batches for e in self._entries_of(b.differing())}
        return [e.name for e in self.entries.values()
                if _layout(e.tensor) != e.layout
                or (e.batch is None or id(e.tensor) in suspects) and _was_changed(e)]

    def _entries_of(self, tensors: list[torch.Tensor]) -> list[_Guarded]:
        return [self.entries[id(t)] for t in tensors]

    def restore(self) -> bool:
        """Put every changed tensor back; False if some contents could not be restored."""
        ok = True
        with torch.no_grad():
            for e in self.entries.values():
                if not _was_changed(e):
                    continue
                if _layout(e.tensor) != e.layout:
                    e.tensor.data = e.data
                backup = e.backup()
                if backup is None:
                    ok = False
                    continue
                for data, saved in zip(_plain(e.data), _plain(backup)):
                    data.copy_(saved)
                e.version = _version(e.tensor)
        return ok


#: a batch's tensors are at most this large (bytes), and it compares this much at a time
_BATCH_TENSOR_BYTES = 1 << 20
_BATCH_CHUNK_BYTES = 32 << 20


def _batchable(t: torch.Tensor) -> bool:
    return (type(t) in (torch.Tensor, nn.Parameter) and t.device.type == "cpu" and t.layout == torch.strided
            and t.element_size() in _SAME_SIZE_INT and t.is_contiguous() and not t.is_conj() and not t.is_neg()
            and 0 < t.numel() * t.element_size() <= _BATCH_TENSOR_BYTES)


class _Batch:
    """Small dense CPU tensors of one element size, guarded together: the backup is one flat
    integer tensor, and a check concatenates the tensors' flat integer views (made once,
    over the data as it was) chunk by chunk and compares each chunk in one C call."""

    def __init__(self, as_int: torch.dtype, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self.views = [t.data.view(-1).view(as_int) for t in tensors]
        self.backup = torch.cat(self.views)
        self.offsets = [0]
        for v in self.views:
            self.offsets.append(self.offsets[-1] + v.numel())
        per_chunk = max(1, _BATCH_CHUNK_BYTES // torch.empty((), dtype=as_int).element_size())
        self.chunks: list[tuple[int, int]] = []  # [start, stop) indices into tensors
        start = 0
        for i in range(1, len(tensors) + 1):
            if i == len(tensors) or self.offsets[i + 1] - self.offsets[start] > per_chunk:
                self.chunks.append((start, i))
                start = i

    def copy_of(self, index: int) -> torch.Tensor:
        """The backup of tensor ``index``: a view of the flat backup with its dtype and shape
        (made when asked: a guard with thousands of tensors rarely needs one)."""
        t = self.tensors[index]
        return self.backup[self.offsets[index]:self.offsets[index + 1]].view(t.dtype).view(t.shape)

    def differing(self) -> list[torch.Tensor]:
        """The tensors of the chunks whose contents differ from the backup (a superset of
        the written ones; their own comparison decides)."""
        out: list[torch.Tensor] = []
        for start, stop in self.chunks:
            now = torch.cat(self.views[start:stop])
            if not torch.equal(now, self.backup[self.offsets[start]:self.offsets[stop]]):
                out.extend(self.tensors[start:stop])
        return out


def _backup(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s contents kept in host memory: a copy on the GPU would raise the
    device's reserved memory (the caching allocator keeps the blocks after the run; a
    training step replayed from its own CUDA-graph pool could never reuse them)."""
    if t.device.type in ("cpu", "meta") or is_traceable_wrapper_subclass(t):
        return t.detach().clone()
    return t.detach().to("cpu", copy=True)


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data (``t`` itself unless it is a wrapper subclass)."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    attrs, _ = t.__tensor_flatten__()
    return [leaf for a in attrs if isinstance(getattr(t, a), torch.Tensor) for leaf in _plain(getattr(t, a))]


def _layout(t: torch.Tensor) -> tuple:
    if type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided and t.device.type != "meta":
        return ((t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.dtype, t.stride()),)

    def one(x: torch.Tensor) -> tuple:
        try:
            ptr = x.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # no real storage (meta, fake, sparse)
            ptr = id(x)
        return ptr, x.storage_offset() if x.layout == torch.strided else 0, x.shape, x.dtype, \
            x.stride() if x.layout == torch.strided else ()

    return tuple(map(one, _plain(t)))


def _version(t: torch.Tensor) -> int:
    # inference tensors have no version counter (and cannot be written outside inference_mode)
    return -1 if t.is_inference() else t._version


def _was_changed(e: _Guarded) -> bool:
    if _layout(e.tensor) != e.layout:
        return True
    backup = e.backup()
    if backup is not None:  # the contents decide: a write of equal values changes nothing
        return not all(map(_bytes_equal, _plain(e.data), _plain(backup)))
    return _version(e.tensor) != e.version


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included); numpy's comparison is the fastest on CPU."""
    as_int = _SAME_SIZE_INT.get(a.element_size())
    try:
        if a.device != b.device:  # a device tensor against its host backup (_backup)
            a = a.to(b.device)
        if as_int is not None and a.layout == torch.strided:
            a, b = a.view(as_int), b.view(as_int)
            if a.device.type == "cpu":
                return bool(np.array_equal(a.numpy(), b.numpy()))
        return bool(torch.equal(a, b))
    except (RuntimeError, TypeError):  # a layout that cannot be compared
        return True
