"""Run a planned GraphModule inside one preallocated arena.

Every planned node writes its result into its arena slice through an ``out=`` kernel
that allocates nothing on the side. Not every op has one. ``relu.out``,
``convolution.out``, ``mkldnn_convolution.out`` and ``native_layer_norm.out`` compute
into a temporary and copy, so: ``relu`` runs as ``clamp_min(x, 0, out=...)`` (bit for
bit the same), a CUDA convolution as ``cudnn_convolution.out`` plus its bias, a CPU 1x1
convolution as ``_slow_conv2d_forward.output`` (one GEMM), layer norm as mean, variance
and an affine map, each into its buffer. A CPU 3x3 or depthwise convolution (NCHW),
a transposed convolution or a user's module have none at all. Such nodes fall back, one
by one, to running as usual (torch's allocator gives them memory);
:attr:`ArenaRunner.unplanned` lists each with the reason and :meth:`ArenaRunner.outside`
counts them by op.

Some kernels write more than their result (max-pool indices, layer-norm statistics,
CUDA batch-norm statistics): that *scratch* is planned like any buffer, live only while
its op runs, so the predicted peak counts it. Views and in-place ops need no memory of
their own: they act on whatever their base is, arena or not. A ``cat`` copies only the
inputs that are not already in their slice (concat-aware placement), so an elided
``cat`` copies nothing; a producer placed in a slice that has no ``out=`` kernel
computes aside and is copied into it once, which is the copy the ``cat`` would have
made anyway.

The planned nodes call their kernels from a copy of the GraphModule's own code, which
frees each value after its last use exactly as the unplanned run does and keeps no
per-run state. (An ``fx.Interpreter``'s environment dict, grown to the graph's size on
every run, was most of the few kB by which planned CPU runs measured above unplanned.)

The runner is for inference: ``out=`` kernels do not record autograd history, so it
runs under ``torch.no_grad()``.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxopt.errors import FxoptError
from fxopt.memory.plan import PLAN_KEY, MemoryPlan, Slot
from fxopt.memory.problem import Buffer, lower_bound
from fxopt.memory.solver import solve

Kernel = Callable[[tuple, dict, torch.Tensor], None]


@dataclass(frozen=True)
class Lowering:
    """How a node writes into the arena: ``make(*scratch)`` returns its kernel, given a tensor
    for each template in ``scratch`` (meta tensors: shape, strides, dtype) for what the op
    writes besides its result. Scratch is planned in the arena for the op's step alone."""

    make: Callable[..., Kernel]
    scratch: tuple[torch.Tensor, ...] = ()


def _plain(kernel: Kernel) -> Lowering:
    return Lowering(lambda: kernel)


def _binary(fn: Callable) -> Kernel:
    def run(args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        fn(args[0], args[1], **{k: v for k, v in kwargs.items() if k == "alpha"}, out=out)
    return run


def _relu(args: tuple, kwargs: dict, out: torch.Tensor) -> None:
    torch.clamp_min(args[0], 0, out=out)  # relu.out would compute aside and copy


def _linear_with(weight: torch.Tensor, bias: torch.Tensor | None) -> Kernel:
    """``F.linear`` as ``addmm``/``mm`` into ``out``: the same kernel F.linear folds to."""
    def run(args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        x = args[0]
        flat = x.reshape(-1, x.shape[-1])
        target = out.view(-1, out.shape[-1])
        if bias is None:
            torch.mm(flat, weight.t(), out=target)
        else:
            torch.addmm(bias, flat, weight.t(), out=target)
    return run


def _functional_linear(args: tuple, kwargs: dict, out: torch.Tensor) -> None:
    weight = args[1] if len(args) > 1 else kwargs["weight"]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    _linear_with(weight, bias)(args[:1], {}, out)


def _batch_norm(bn: nn.modules.batchnorm._BatchNorm, dtype: torch.dtype) -> Lowering:
    """Eval-mode batch norm through ``native_batch_norm.out`` (the kernel F.batch_norm runs on CPU).

    ``save_mean`` and ``save_invstd`` must be two tensors. On CUDA the eval path writes the
    running mean into ``save_mean`` and ``1/sqrt(var + eps)`` into ``save_invstd`` (per
    channel, in the accumulation type: float32 for half inputs), then normalizes with
    those two: given one tensor for both, it normalized with ``x - invstd`` (the wrong
    result of the CUDA arena runs); so there they are scratch in the arena. On CPU the
    eval path leaves them empty and wants them in the input's dtype: two empty tensors.
    """
    device = bn.running_mean.device

    def make(*stats: torch.Tensor) -> Kernel:
        save_mean, save_invstd = stats or (torch.empty(0, device=device, dtype=dtype) for _ in range(2))

        def run(args: tuple, kwargs: dict, out: torch.Tensor) -> None:
            torch.ops.aten.native_batch_norm.out(args[0], bn.weight, bn.bias, bn.running_mean,
                                                 bn.running_var, False, 0.0, bn.eps, out=out,
                                                 save_mean=save_mean, save_invstd=save_invstd)
        return run

    if device.type != "cuda":
        return Lowering(make)
    stats = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    return Lowering(make, tuple(torch.empty(bn.num_features, device="meta", dtype=stats) for _ in range(2)))


def _cudnn_conv_with(conv: nn.Conv2d) -> Kernel:
    """A CUDA convolution through ``cudnn_convolution.out``, a real out= kernel (cuDNN writes
    the result in place; its workspace is a temporary, as in eager), then the bias added in
    place: the two steps eager's ``aten.convolution`` takes on the cuDNN backend."""
    padding, stride, dilation = list(conv.padding), list(conv.stride), list(conv.dilation)
    bias = None if conv.bias is None else conv.bias.view(1, -1, 1, 1)

    def run(args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        cudnn = torch.backends.cudnn
        torch.ops.aten.cudnn_convolution.out(args[0], conv.weight, padding, stride, dilation, conv.groups,
                                             cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32, out=out)
        if bias is not None:
            out.add_(bias)
    return run


def _cudnn_can_write(conv: nn.Module, node: fx.Node) -> bool:
    """Whether ``conv`` runs as :func:`_cudnn_conv_with` into ``node``'s planned layout
    without a copy: a plain 2-d CUDA convolution in a cuDNN dtype whose input, weight and
    output share one memory format (else cuDNN would copy them to make them agree)."""
    if not (type(conv) is nn.Conv2d and conv.padding_mode == "zeros" and isinstance(conv.padding, tuple)
            and conv.weight.is_cuda and torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled
            and conv.weight.dtype in (torch.float32, torch.float16, torch.bfloat16)):
        return False
    x, out = node.args[0].meta.get("val"), node.meta.get("val")
    if not (isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor) and x.dim() == 4 and not node.kwargs):
        return False
    last = torch.channels_last
    fmt = last if (x.is_contiguous(memory_format=last) and not x.is_contiguous()) or (
        conv.weight.is_contiguous(memory_format=last) and not conv.weight.is_contiguous()) else torch.contiguous_format
    return all(t.is_contiguous(memory_format=fmt) for t in (x, conv.weight, out))


def _onednn_can_write(conv: nn.Module, node: fx.Node) -> bool:
    """Whether ``conv`` is a CPU convolution that oneDNN writes straight into ``out``: its
    in-place fused path (``mkldnn::_convolution_pointwise_.binary``, "add" into ``out``)
    runs only with channels-last tensors, and otherwise computes aside and adds."""
    if not (type(conv) is nn.Conv2d and conv.padding_mode == "zeros" and isinstance(conv.padding, tuple)
            and conv.weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and torch.backends.mkldnn.enabled and conv.weight.dtype in (torch.float32, torch.bfloat16)):
        return False
    x, out = node.args[0].meta.get("val"), node.meta.get("val")
    if not (isinstance(x, torch.Tensor) and x.dim() == 4 and not node.kwargs and x.dtype == conv.weight.dtype):
        return False
    last = torch.channels_last
    return (out.is_contiguous(memory_format=last) and not out.is_contiguous()
            and any(t.is_contiguous(memory_format=last) and not t.is_contiguous() for t in (x, conv.weight)))


def _onednn_conv(conv: nn.Conv2d) -> Kernel:
    """A channels-last CPU convolution as oneDNN's fused conv + sum into a zeroed ``out``:
    ``0 + conv(x)`` is ``conv(x)`` bit for bit, and nothing is allocated aside."""
    padding, stride, dilation = list(conv.padding), list(conv.stride), list(conv.dilation)

    def run(args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        torch.ops.mkldnn._convolution_pointwise_.binary(out.zero_(), args[0], conv.weight, conv.bias, padding,
                                                        stride, dilation, conv.groups, "add", None, None, [], None)
    return run


def _pair(v: int | tuple[int, ...] | list[int]) -> list[int]:
    return [v, v] if isinstance(v, int) else list(v)


def _adaptive_avg_pool(size: Any) -> Kernel:
    """``adaptive_avg_pool2d`` as eager runs it: a mean over H and W for a 1x1 output, else
    the pooling kernel (both write straight into ``out``)."""
    size = _pair(size)
    if size == [1, 1]:
        return lambda args, kwargs, out: torch.mean(args[0], (-1, -2), keepdim=True, out=out)
    return lambda args, kwargs, out: torch.ops.aten._adaptive_avg_pool2d.out(args[0], size, out=out)


def _avg_pool(kernel_size: Any, stride: Any, padding: Any, ceil_mode: bool, count_include_pad: bool,
              divisor_override: int | None) -> Kernel:
    """``avg_pool2d`` through its structured ``out=`` kernel, the one eager runs."""
    def run(args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        torch.ops.aten.avg_pool2d.out(args[0], kernel_size, stride or kernel_size, padding, ceil_mode,
                                      count_include_pad, divisor_override, out=out)
    return run


def _max_pool(node: fx.Node, kernel_size: Any, stride: Any, padding: Any, dilation: Any,
              ceil_mode: bool) -> Lowering | None:
    """``max_pool2d`` through ``max_pool2d_with_indices.out``: the indices it must write too
    (int64, the output's shape) are scratch, planned in the arena for this step only."""
    val = node.meta["val"]
    if val.dim() not in (3, 4) or val.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        return None
    kernel_size, padding, dilation = _pair(kernel_size), _pair(padding), _pair(dilation)
    stride = _pair(stride) if stride else kernel_size
    indices = torch.empty_strided(val.shape, val.stride(), dtype=torch.int64, device="meta")

    def make(indices: torch.Tensor) -> Kernel:
        def run(args: tuple, kwargs: dict, out: torch.Tensor) -> None:
            torch.ops.aten.max_pool2d_with_indices.out(args[0], kernel_size, stride, padding, dilation, ceil_mode,
                                                       out=out, indices=indices)
        return run

    return Lowering(make, (indices,))


def _layer_norm(node: fx.Node, normalized_shape: Any, eps: float,
                params: Callable[[tuple, dict], tuple[torch.Tensor | None, torch.Tensor | None]]) -> Lowering | None:
    """Layer norm as mean, variance, ``(x - mean) * rsqrt(var + eps) * weight + bias``, each
    written into its buffer (``native_layer_norm.out`` computes aside and copies). The
    statistics are scratch. Full-precision floats only: eager accumulates half inputs in
    float32, which this would not. ``params(args, kwargs)`` gives the weight and bias."""
    val = node.meta["val"]
    if val.dtype not in (torch.float32, torch.float64) or not val.is_contiguous():
        return None
    dims = tuple(range(-len(tuple(normalized_shape)), 0))
    stats_shape = [*val.shape[:val.dim() - len(dims)], *(1 for _ in dims)]
    template = torch.empty(stats_shape, dtype=val.dtype, device="meta")

    def make(mean: torch.Tensor, rstd: torch.Tensor) -> Kernel:
        def run(args: tuple, kwargs: dict, out: torch.Tensor) -> None:
            x, (weight, bias) = args[0], params(args, kwargs)
            torch.mean(x, dims, keepdim=True, out=mean)
            torch.var(x, dims, correction=0, keepdim=True, out=rstd)
            torch.sub(x, mean, out=out).mul_(rstd.add_(eps).rsqrt_())
            if weight is not None:
                out.mul_(weight)
            if bias is not None:
                out.add_(bias)
        return run

    return Lowering(make, (template, template))


def _pointwise_conv_can_write(conv: nn.Module, node: fx.Node) -> bool:
    """Whether ``conv`` is a CPU 1x1 convolution that ``_slow_conv2d_forward.output`` writes
    straight into ``out``: stride 1, no padding, one group, contiguous. That kernel runs one
    GEMM per image on the input as it lies (any other shape first builds an im2col buffer
    of kernel-area times the input, larger than the output it saves)."""
    if not (type(conv) is nn.Conv2d and conv.weight.device.type == "cpu" and conv.kernel_size == (1, 1)
            and conv.stride == (1, 1) and conv.padding in ((0, 0), "valid") and conv.dilation == (1, 1)
            and conv.groups == 1 and conv.weight.dtype in (torch.float32, torch.float64)):
        return False
    x, out = node.args[0].meta.get("val"), node.meta.get("val")
    return (isinstance(x, torch.Tensor) and x.dim() == 4 and not node.kwargs and x.is_contiguous()
            and out.is_contiguous() and conv.weight.is_contiguous())


def _pointwise_conv(conv: nn.Conv2d) -> Kernel:
    def run(args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        torch.ops.aten._slow_conv2d_forward.output(args[0], conv.weight, [1, 1], conv.bias, [1, 1], [0, 0],
                                                   output=out)
    return run


_FUNCTION_KERNELS: dict[Any, Kernel] = {
    operator.add: _binary(torch.add), torch.add: _binary(torch.add),
    operator.sub: _binary(torch.sub), torch.sub: _binary(torch.sub),
    operator.mul: _binary(torch.mul), torch.mul: _binary(torch.mul),
    operator.truediv: _binary(torch.div), torch.div: _binary(torch.div),
    torch.relu: _relu, F.relu: _relu, torch.matmul: _binary(torch.matmul),
    torch.mm: _binary(torch.mm), torch.bmm: _binary(torch.bmm), F.linear: _functional_linear,
    torch.ops.aten.add.Tensor: _binary(torch.add), torch.ops.aten.mul.Tensor: _binary(torch.mul),
    torch.ops.aten.sub.Tensor: _binary(torch.sub), torch.ops.aten.relu.default: _relu,
    torch.ops.aten.mm.default: _binary(torch.mm), torch.ops.aten.bmm.default: _binary(torch.bmm),
    torch.ops.aten.linear.default: _functional_linear,
}
_METHOD_KERNELS: dict[str, Kernel] = {
    "add": _binary(torch.add), "sub": _binary(torch.sub), "mul": _binary(torch.mul),
    "div": _binary(torch.div), "relu": _relu, "matmul": _binary(torch.matmul),
}
_CATS = (torch.cat, torch.concat, torch.ops.aten.cat.default)


@dataclass
class _Extras:
    """Buffers beyond the plan's, each live at one node: ``scratch_of`` maps a plan buffer to
    its writers' scratch (in the arena when the buffer is kept, allocated by torch when not),
    ``aside_of`` to the results its hosted copies compute aside (outside, only when it is
    kept); ``scratch_ids`` maps a node to its scratch. Indices point into ``buffers``."""

    buffers: list[Buffer]
    scratch_of: dict[int, list[int]] = field(default_factory=dict)
    aside_of: dict[int, list[int]] = field(default_factory=dict)
    scratch_ids: dict[str, list[int]] = field(default_factory=dict)

    def add(self, owner: int, into: dict[int, list[int]], new: list[Buffer]) -> list[int]:
        ids = list(range(len(self.buffers), len(self.buffers) + len(new)))
        self.buffers += new
        into.setdefault(owner, []).extend(ids)
        return ids


class ArenaError(FxoptError, RuntimeError):
    """The GraphModule has no memory plan, or it no longer matches the graph."""


def _device_of(gm: fx.GraphModule) -> torch.device:
    """Where the graph computes: its inputs' device as recorded by shape propagation, else
    its weights'. (Weights alone are not enough: a graph of parameter-free ops, e.g. pools
    and arithmetic, has none, and its arena must still be on the inputs' GPU.)"""
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val", node.meta.get("example_value"))
        if isinstance(value, torch.Tensor):
            return value.device
    tensor = next(iter(gm.parameters()), next(iter(gm.buffers()), None))
    return tensor.device if tensor is not None else torch.device("cpu")


class ArenaRunner:
    """Executes ``gm`` with all planned intermediates inside one preallocated arena.

    Call it like the GraphModule. ``unplanned`` maps node names to why they run outside
    the arena; ``planned`` lists the nodes that write into it; ``arena_bytes`` is the
    arena actually allocated (the plan's buffers that some node writes and that do not
    raise the peak, with their scratch, placed again); ``module`` is the GraphModule that
    runs. ``keep_all=True`` keeps every buffer some node can write, even where the
    prediction says that raises the peak: a steady state with no allocator call per
    planned node (what usually tips the prediction is the graph's output, allocated on
    top of the whole arena). ``predicted_peak`` and ``predicted_unplanned_peak`` are the
    peak bytes of the run with and without the arena, by the plan's lifetimes: the arena
    plus the most bytes the buffers outside it (outputs and scratch included) hold at
    once, against the most bytes all buffers hold at once (torch's temporaries inside an
    op aside).
    """

    def __init__(self, gm: fx.GraphModule, plan: MemoryPlan | None = None,
                 device: torch.device | str | None = None, *, keep_all: bool = False):
        plan = plan if plan is not None else gm.meta.get(PLAN_KEY)
        if plan is None:
            raise ArenaError("the GraphModule has no memory plan: run the plan_memory pass first")
        self.keep_all = keep_all
        self.gm, self.plan = gm, plan
        if device is None:
            device = _device_of(gm)
        self.unplanned: dict[str, str] = dict(plan.unplanned)
        self.planned: list[str] = []
        self.steps: dict[fx.Node, Callable[[tuple, dict], Any]] = {}
        self.lowerings = {n: lowering for n in gm.graph.nodes if n.name in plan.slots and plan.slots[n.name].owner
                          and (lowering := self._lowering(n)) is not None}
        self.slots, self.scratch = self._replan(gm, plan)
        self.arena_bytes = max([s.offset + s.size for s in self.slots.values()]
                               + [offset + size for places in self.scratch.values() for offset, size in places],
                               default=0)
        self.arena = torch.empty(self.arena_bytes, dtype=torch.uint8, device=device)
        for node in gm.graph.nodes:
            self._prepare(node)
        self.module = self._planned_module()

    def _replan(self, gm: fx.GraphModule, plan: MemoryPlan) -> tuple[dict[str, Slot], dict[str, list[tuple[int, int]]]]:
        """The plan without the buffers that would not lower the run's peak, plus scratch.

        A buffer can go into the arena if some storage in it has a producer that writes
        there (an ``out=`` kernel, a ``cat``, or a slice of a ``cat``); the others are
        allocated by torch while the run goes. Scratch counts on both sides: a kept
        buffer brings its writers' scratch into the arena, and a writer left outside
        allocates the same extra outputs through torch (eager's ``max_pool2d`` returns its
        indices, ``layer_norm`` its statistics), each live at its op alone.

        The arena is held for the whole run, so keeping a buffer in it pays only if it
        does not raise the predicted peak, arena plus the most bytes torch holds at one
        time: with most of a graph outside the arena, its slices sit idle while the
        outside buffers peak. Writable buffers are dropped, largest first, while that
        lowers the prediction. Then no arena at all if running without one is predicted
        lower, or equal while buffers stay outside: a tie saves nothing, and the planned
        run would differ from the plain one only in where torch's own small transients
        fall (a few kB on CPU, at a convolution instead of a batch norm). A tie with every
        buffer inside is kept: that run allocates nothing but its outputs. The kept
        buffers are placed again. Returns the kept slots and, per node, the (offset,
        size) of each scratch tensor.

        A producer hosted in a kept ``cat`` buffer without a kernel of its own computes its
        result aside (outside, live at its step) and copies it in: counted too. So are the
        graph's outputs, on both sides: the caller keeps them, so they are allocated by
        torch in either run, but in the planned one on top of the whole arena.
        """
        writable = {plan.slots[n.name].buffer for n in gm.graph.nodes
                    if n.name in plan.slots and plan.slots[n.name].owner and self._writes_arena(n)}
        extras = self._extras(gm, plan)
        buffers = extras.buffers
        aside = {j for ids in extras.aside_of.values() for j in ids}
        # concat-aware placement is the plan's: the unplanned run allocates each cat input on
        # its own, so its peak is at least the bound before merging
        self.predicted_unplanned_peak = max(
            lower_bound([*(b for i, b in enumerate(buffers) if i not in aside), *plan.outputs]),
            plan.lower_bound_before_concat)

        def inside(kept: set[int]) -> set[int]:
            return kept | {j for i in kept for j in extras.scratch_of.get(i, ())}

        def outside(kept: set[int]) -> set[int]:
            arena_side = inside(kept)
            return ({i for i in range(len(buffers)) if i not in arena_side and i not in aside}
                    | {j for i in kept for j in extras.aside_of.get(i, ())})

        def place(kept: set[int], seconds: float) -> dict[int, int]:
            """Offsets for the kept buffers: the plan's own (valid for any subset of its
            buffers, optimal for all of them) or a placement of the subset alone, whichever
            is smaller; scratch has no offset in the plan."""
            order = sorted(kept)
            solution = solve([Buffer(buffers[i].name, buffers[i].start, buffers[i].end, buffers[i].size)
                              for i in order], time_limit=seconds)
            if all(i < len(plan.buffers) for i in order) and max(
                    (buffers[i].offset + buffers[i].size for i in order), default=0) <= solution.arena:
                return {i: buffers[i].offset for i in order}
            return dict(zip(order, solution.offsets))

        def peak(kept: set[int]) -> int:
            offsets = place(inside(kept), 0.02)
            arena = max((offsets[i] + buffers[i].size for i in offsets), default=0)
            return arena + lower_bound([*(buffers[i] for i in outside(kept)), *plan.outputs])

        keep, best = set(writable), peak(writable)
        if not self.keep_all:
            keep, best = self._drop(keep, best, peak, outside, len(plan.buffers))
        self.predicted_peak = best
        self.dropped = writable - keep
        offsets = place(inside(keep), 0.2)
        slots = {name: Slot(slot.offset - plan.buffers[slot.buffer].offset + offsets[slot.buffer], slot.size,
                            slot.owner, slot.hosted, slot.buffer)
                 for name, slot in plan.slots.items() if slot.buffer in keep}
        scratch = {name: [(offsets[j], buffers[j].size) for j in ids]
                   for name, ids in extras.scratch_ids.items() if ids and ids[0] in offsets}
        return slots, scratch

    def _drop(self, keep: set[int], best: int, peak: Callable[[set[int]], int],
              outside: Callable[[set[int]], set[int]], planned: int) -> tuple[set[int], int]:
        """The buffers worth keeping and their predicted peak: drop the largest first while
        that lowers the prediction; keep none if running without an arena is predicted
        lower, or equal while buffers stay outside (see :meth:`_replan`)."""
        for i in sorted(keep, key=lambda i: -self.plan.buffers[i].size):
            if (candidate := peak(keep - {i})) < best:
                keep, best = keep - {i}, candidate
        everything = len(keep) == planned and not outside(keep)
        if best > self.predicted_unplanned_peak or (best == self.predicted_unplanned_peak and not everything):
            return set(), self.predicted_unplanned_peak
        return keep, best

    def _extras(self, gm: fx.GraphModule, plan: MemoryPlan) -> _Extras:
        """The plan's buffers followed by the extra ones, each live at its node alone."""
        extras = _Extras(list(plan.buffers))
        for t, node in enumerate(gm.graph.nodes):
            if node.name not in plan.slots or not plan.slots[node.name].owner or not self._writes_arena(node):
                continue
            lowering, owner = self.lowerings.get(node), plan.slots[node.name].buffer
            if lowering is not None and not _has_out_kwarg(node):
                extras.scratch_ids[node.name] = extras.add(owner, extras.scratch_of, [
                    Buffer(f"{node.name}.scratch{k}", t, t, _align(x.untyped_storage().nbytes(), plan.alignment))
                    for k, x in enumerate(lowering.scratch)])
            elif not (node.op == "call_function" and node.target in _CATS):  # a hosted copy
                extras.add(owner, extras.aside_of, [Buffer(f"{node.name}.aside", t, t, plan.slots[node.name].size)])
        return extras

    def _writes_arena(self, node: fx.Node) -> bool:
        if not isinstance(node.meta.get("val"), torch.Tensor):
            return False
        if node.op == "call_function" and node.target in _CATS:
            return True
        return self.plan.slots[node.name].hosted or (node in self.lowerings and not _has_out_kwarg(node))

    # -- building the steps -------------------------------------------------------------

    def _tensor_at(self, like: torch.Tensor, offset: int) -> torch.Tensor:
        """A tensor on the arena's bytes from ``offset``, with ``like``'s shape, strides and dtype."""
        base = self.arena[offset: offset + like.untyped_storage().nbytes()].view(like.dtype)
        # as_strided's offset counts from the arena's start, not from the slice's
        return base.as_strided(like.shape, like.stride(), base.storage_offset() + like.storage_offset())

    def _lowering(self, node: fx.Node) -> Lowering | None:
        first = node.args[0] if node.args else None
        if not (isinstance(first, fx.Node) and isinstance(first.meta.get("val"), torch.Tensor)
                and isinstance(node.meta.get("val"), torch.Tensor)):
            return None  # `1 + x` is operator.add(1, x): the out= kernels take a tensor first
        if node.op == "call_function":
            return _function_lowering(node)
        if node.op == "call_method":
            kernel = _METHOD_KERNELS.get(node.target)
            return None if kernel is None else _plain(kernel)
        if node.op == "call_module":
            return _module_lowering(self.gm.get_submodule(node.target), node)
        return None

    def _prepare(self, node: fx.Node) -> None:
        if node.name not in self.plan.slots or not self.plan.slots[node.name].owner:
            return  # a view or an in-place op acts on its base, wherever that is
        if not isinstance(node.meta.get("val"), torch.Tensor):
            self.unplanned[node.name] = f"no allocation-free out= kernel for {_describe(node)} (not one tensor)"
            return
        if node.name not in self.slots:
            self.unplanned[node.name] = (
                "outside the arena: keeping it there would not lower the predicted peak"
                if self.plan.slots[node.name].buffer in self.dropped
                else f"no allocation-free out= kernel for {_describe(node)}")
            return
        out = self._tensor_at(node.meta["val"], self.slots[node.name].offset)
        if node.op == "call_function" and node.target in _CATS:
            self.steps[node] = self._cat_step(node, out)
            self.planned.append(node.name)
            return
        lowering = self.lowerings.get(node)
        if lowering is not None and not _has_out_kwarg(node):
            scratch = [self._tensor_at(like, offset)
                       for like, (offset, _) in zip(lowering.scratch, self.scratch.get(node.name, ()))]
            kernel = lowering.make(*scratch)
            self.steps[node] = lambda args, kwargs, k=kernel, o=out: (k(args, kwargs, o), o)[1]
            self.planned.append(node.name)
        elif self.plan.slots[node.name].hosted:
            # the cat this feeds would have copied it anyway: copy once, into its slice
            self.steps[node] = lambda args, kwargs, n=node, o=out: o.copy_(self._default(n, args, kwargs))
            self.planned.append(node.name)
            self.unplanned[node.name] = "no allocation-free out= kernel: computed aside, copied into its cat slice"
        else:
            self.unplanned[node.name] = f"no allocation-free out= kernel for {_describe(node)}"

    def _cat_step(self, node: fx.Node, out: torch.Tensor) -> Callable[[tuple, dict], Any]:
        """Copy each input into its slice of ``out``, unless it was written there already."""
        dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % out.dim()

        def run(args: tuple, kwargs: dict) -> torch.Tensor:
            start = 0
            for t in args[0] if args else kwargs["tensors"]:
                length = t.shape[dim]
                target = out.narrow(dim, start, length)
                if not _same_memory(t, target):
                    target.copy_(t)
                start += length
            return out

        return run

    def _default(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return self.gm.get_submodule(node.target)(*args, **kwargs)

    def _planned_module(self) -> fx.GraphModule:
        """``gm`` with each planned node calling its step instead (``gm`` itself if none is).

        The GraphModule's generated code frees every value after its last use, exactly as
        the unplanned run does, and holds no state between nodes but the values; submodules
        and parameters are shared with ``gm``, and so is the calling convention (codegen).
        """
        if not self.steps:
            return self.gm
        graph = fx.Graph()
        graph._codegen = copy.deepcopy(self.gm.graph._codegen)
        env: dict[fx.Node, fx.Node] = {}
        for node in self.gm.graph.nodes:
            step = self.steps.get(node)
            if step is None:
                env[node] = graph.node_copy(node, env.__getitem__)
                continue
            env[node] = graph.create_node("call_function", _Step(node.name, step), fx.map_arg(node.args, env.__getitem__),
                                          fx.map_arg(node.kwargs, env.__getitem__), name=node.name)
            env[node].meta = dict(node.meta)
        return fx.GraphModule(self.gm, graph)

    def outside(self) -> dict[str, int]:
        """How many nodes of each op run outside the arena (the graph's outputs aside, which
        the caller owns in any run): what keeps the plan from being executed in full."""
        nodes = {n.name: n for n in self.gm.graph.nodes}
        counts: dict[str, int] = {}
        for name, reason in self.unplanned.items():
            if name in nodes and not reason.startswith("returned by the graph"):
                op = _describe(nodes[name])
                counts[op] = counts.get(op, 0) + 1
        return dict(sorted(counts.items(), key=lambda item: -item[1]))

    # -- running ------------------------------------------------------------------------

    def __call__(self, *inputs: Any) -> Any:
        with torch.no_grad():
            return self.module(*inputs)


class _Step:
    """One planned node as the planned GraphModule calls it: its kernel into its arena slice.

    A named callable object, not a lambda, because FX's code generation refers to a
    call_function target by its name.
    """

    def __init__(self, name: str, run: Callable[[tuple, dict], Any]):
        self.__name__ = f"arena_{name}"
        self.run = run

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(args, kwargs)


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _norm_params(args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The weight and bias of a ``layer_norm(input, normalized_shape, weight, bias, ...)`` call."""
    return (args[2] if len(args) > 2 else kwargs.get("weight"), args[3] if len(args) > 3 else kwargs.get("bias"))


def _function_lowering(node: fx.Node) -> Lowering | None:
    target = node.target
    if target in (F.adaptive_avg_pool2d, torch.ops.aten.adaptive_avg_pool2d.default):
        return _plain(_adaptive_avg_pool(_arg(node, 1, "output_size")))
    if target in (F.max_pool2d, torch.ops.aten.max_pool2d.default) and not _arg(node, 6, "return_indices", False):
        return _max_pool(node, _arg(node, 1, "kernel_size"), _arg(node, 2, "stride", ()), _arg(node, 3, "padding", 0),
                         _arg(node, 4, "dilation", 1), _arg(node, 5, "ceil_mode", False))
    if target in (F.layer_norm, torch.ops.aten.layer_norm.default):
        return _layer_norm(node, _arg(node, 1, "normalized_shape"), _arg(node, 4, "eps", 1e-5), _norm_params)
    try:
        kernel = _FUNCTION_KERNELS.get(target)
    except TypeError:
        return None
    return None if kernel is None else _plain(kernel)


def _module_lowering(mod: nn.Module, node: fx.Node) -> Lowering | None:
    if _cudnn_can_write(mod, node):
        return _plain(_cudnn_conv_with(mod))
    if _onednn_can_write(mod, node):
        return _plain(_onednn_conv(mod))
    if _pointwise_conv_can_write(mod, node):
        return _plain(_pointwise_conv(mod))
    if type(mod) is nn.Linear:
        return _plain(_linear_with(mod.weight, mod.bias))
    if type(mod) is nn.ReLU and not mod.inplace:
        return _plain(_relu)
    if type(mod) is nn.AdaptiveAvgPool2d:
        return _plain(_adaptive_avg_pool(mod.output_size))
    if type(mod) is nn.AvgPool2d:
        return _plain(_avg_pool(mod.kernel_size, mod.stride, mod.padding, mod.ceil_mode, mod.count_include_pad,
                                mod.divisor_override))
    if type(mod) is nn.MaxPool2d and not mod.return_indices:
        return _max_pool(node, mod.kernel_size, mod.stride, mod.padding, mod.dilation, mod.ceil_mode)
    if type(mod) is nn.LayerNorm:
        return _layer_norm(node, mod.normalized_shape, mod.eps, lambda args, kwargs: (mod.weight, mod.bias))
    if (isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)) and not mod.training
            and mod.running_mean is not None):
        return _batch_norm(mod, node.meta["val"].dtype)
    return None


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory (size-1 strides aside)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and all(
        x == y for x, y, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def _has_out_kwarg(node: fx.Node) -> bool:
    return "out" in node.kwargs


def _describe(node: fx.Node) -> str:
    if node.op == "call_module":
        return type(node.graph.owning_module.get_submodule(node.target)).__name__
    return getattr(node.target, "__name__", str(node.target))
