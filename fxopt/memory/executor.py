"""Run a planned GraphModule inside one preallocated arena.

Every planned node writes its result into its arena slice through an ``out=`` kernel
that allocates nothing on the side. Not every op has one: ``relu.out`` and
``convolution.out`` compute into a temporary and copy (so ``relu`` runs as
``clamp_min(x, 0, out=...)``, bit for bit the same, and a CUDA convolution as
``cudnn_convolution.out`` plus its bias), and a CPU convolution, layer norm or a
user's module have none at all. Such nodes fall back, one by one, to running as usual
(torch's allocator gives them memory); :attr:`ArenaRunner.unplanned` lists each with
the reason. Views and in-place ops need no memory of their own: they act on whatever
their base is, arena or not. A ``cat`` copies only the inputs that are not already in
their slice (concat-aware placement), so an elided ``cat`` copies nothing; a producer
placed in a slice that has no ``out=`` kernel computes aside and is copied into it
once, which is the copy the ``cat`` would have made anyway.

The runner is for inference: ``out=`` kernels do not record autograd history, so it
runs under ``torch.no_grad()``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
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


def _batch_norm_with(bn: nn.modules.batchnorm._BatchNorm, dtype: torch.dtype) -> Kernel:
    """Eval-mode batch norm through ``native_batch_norm.out`` (the kernel F.batch_norm runs on CPU).

    ``save_mean`` and ``save_invstd`` must be two tensors, made once here so the run
    allocates nothing. On CUDA the eval path writes the running mean into ``save_mean``
    and ``1/sqrt(var + eps)`` into ``save_invstd`` (per channel, in the accumulation
    type: float32 for half inputs), then normalizes with those two: given one tensor for
    both, it normalized with ``x - invstd`` (the wrong result of the CUDA arena runs). On
    CPU the eval path leaves them empty and wants them in the input's dtype.
    """
    device = bn.running_mean.device
    if device.type == "cuda":
        stats = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        save_mean, save_invstd = (torch.empty(bn.num_features, device=device, dtype=stats) for _ in range(2))
    else:
        save_mean, save_invstd = (torch.empty(0, device=device, dtype=dtype) for _ in range(2))

    def run(args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        torch.ops.aten.native_batch_norm.out(args[0], bn.weight, bn.bias, bn.running_mean,
                                             bn.running_var, False, 0.0, bn.eps, out=out,
                                             save_mean=save_mean, save_invstd=save_invstd)
    return run


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


def _global_avg_pool(args: tuple, kwargs: dict, out: torch.Tensor) -> None:
    torch.mean(args[0], (-1, -2), keepdim=True, out=out)  # what adaptive_avg_pool2d(.., 1) runs


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
}
_METHOD_KERNELS: dict[str, Kernel] = {
    "add": _binary(torch.add), "sub": _binary(torch.sub), "mul": _binary(torch.mul),
    "div": _binary(torch.div), "relu": _relu, "matmul": _binary(torch.matmul),
}
_CATS = (torch.cat, torch.concat, torch.ops.aten.cat.default)


class ArenaError(FxoptError, RuntimeError):
    """The GraphModule has no memory plan, or it no longer matches the graph."""


class ArenaRunner:
    """Executes ``gm`` with all planned intermediates inside one preallocated arena.

    Call it like the GraphModule. ``unplanned`` maps node names to why they run outside
    the arena; ``planned`` lists the nodes that write into it; ``arena_bytes`` is the
    arena actually allocated (the plan's buffers that some node writes and that lower
    the peak, placed again). ``predicted_peak`` and ``predicted_unplanned_peak`` are the
    peak bytes of the run with and without the arena, by the plan's lifetimes (outputs and
    unplanned storages aside, which both runs hold alike; torch's temporaries inside an op
    aside too).
    """

    def __init__(self, gm: fx.GraphModule, plan: MemoryPlan | None = None,
                 device: torch.device | str | None = None):
        plan = plan if plan is not None else gm.meta.get(PLAN_KEY)
        if plan is None:
            raise ArenaError("the GraphModule has no memory plan: run the plan_memory pass first")
        self.gm, self.plan = gm, plan
        if device is None:
            tensor = next(iter(gm.parameters()), None)
            device = tensor.device if tensor is not None else "cpu"
        self.unplanned: dict[str, str] = dict(plan.unplanned)
        self.planned: list[str] = []
        self.steps: dict[fx.Node, Callable[[tuple, dict], Any]] = {}
        self.slots = self._replan(gm, plan)
        self.arena_bytes = max((s.offset + s.size for s in self.slots.values()), default=0)
        self.arena = torch.empty(self.arena_bytes, dtype=torch.uint8, device=device)
        for node in gm.graph.nodes:
            self._prepare(node)

    def _replan(self, gm: fx.GraphModule, plan: MemoryPlan) -> dict[str, Slot]:
        """The plan without the buffers that would not lower the run's peak.

        A buffer can go into the arena if some storage in it has a producer that writes
        there (an ``out=`` kernel, a ``cat``, or a slice of a ``cat``); the others are
        allocated by torch while the run goes. The arena is held for the whole run, so
        keeping a buffer in it pays only if it does not raise the predicted peak, arena
        plus the most bytes torch holds at one time: with most of a graph outside the
        arena, its slices sit idle while the outside buffers peak. Writable buffers are
        dropped, largest first, while that lowers the prediction, and none are kept if
        running without an arena is predicted lower still; the kept ones are placed again.
        """
        writable = {plan.slots[n.name].buffer for n in gm.graph.nodes
                    if n.name in plan.slots and plan.slots[n.name].owner and self._writes_arena(n)}
        buffers = plan.buffers
        self.predicted_unplanned_peak = lower_bound(buffers)

        def place(kept: set[int], seconds: float) -> dict[int, int]:
            """Offsets for the kept buffers: the plan's own (valid for any subset, optimal
            for all of them) or a placement of the subset alone, whichever is smaller."""
            order = sorted(kept)
            solution = solve([Buffer(buffers[i].name, buffers[i].start, buffers[i].end, buffers[i].size)
                              for i in order], time_limit=seconds)
            own = max((buffers[i].offset + buffers[i].size for i in order), default=0)
            if own <= solution.arena:
                return {i: buffers[i].offset for i in order}
            return dict(zip(order, solution.offsets))

        def peak(kept: set[int]) -> int:
            offsets = place(kept, 0.02)
            arena = max((offsets[i] + buffers[i].size for i in kept), default=0)
            return arena + lower_bound(b for i, b in enumerate(buffers) if i not in kept)

        keep, best = set(writable), peak(writable)
        for i in sorted(writable, key=lambda i: -buffers[i].size):
            if (candidate := peak(keep - {i})) < best:
                keep, best = keep - {i}, candidate
        if best > self.predicted_unplanned_peak:
            keep, best = set(), self.predicted_unplanned_peak
        self.predicted_peak = best
        self.dropped = writable - keep
        moved = {i: new - buffers[i].offset for i, new in place(keep, 0.2).items()}
        return {name: Slot(slot.offset + moved[slot.buffer], slot.size, slot.owner, slot.hosted, slot.buffer)
                for name, slot in plan.slots.items() if slot.buffer in moved}

    def _writes_arena(self, node: fx.Node) -> bool:
        if not isinstance(node.meta.get("val"), torch.Tensor):
            return False
        if node.op == "call_function" and node.target in _CATS:
            return True
        return self.plan.slots[node.name].hosted or (
            self._kernel(node) is not None and not _has_out_kwarg(node))

    # -- building the steps -------------------------------------------------------------

    def _view(self, node: fx.Node) -> torch.Tensor:
        """``node``'s value as a tensor on its arena bytes, with its planned layout."""
        val = node.meta["val"]
        slot = self.slots[node.name]
        base = self.arena[slot.offset: slot.offset + val.untyped_storage().nbytes()].view(val.dtype)
        # as_strided's offset counts from the arena's start, not from the slice's
        return base.as_strided(val.shape, val.stride(), base.storage_offset() + val.storage_offset())

    def _kernel(self, node: fx.Node) -> Kernel | None:
        first = node.args[0] if node.args else None
        if not (isinstance(first, fx.Node) and isinstance(first.meta.get("val"), torch.Tensor)):
            return None  # `1 + x` is operator.add(1, x): the out= kernels take a tensor first
        if node.op == "call_function":
            try:
                return _FUNCTION_KERNELS.get(node.target)
            except TypeError:
                return None
        if node.op == "call_method":
            return _METHOD_KERNELS.get(node.target)
        if node.op == "call_module":
            mod = self.gm.get_submodule(node.target)
            if _cudnn_can_write(mod, node):
                return _cudnn_conv_with(mod)
            if type(mod) is nn.Linear:
                return _linear_with(mod.weight, mod.bias)
            if type(mod) is nn.ReLU and not mod.inplace:
                return _relu
            if type(mod) is nn.AdaptiveAvgPool2d and mod.output_size in (1, (1, 1)):
                return _global_avg_pool
            if (isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)) and not mod.training
                    and mod.running_mean is not None):
                return _batch_norm_with(mod, node.meta["val"].dtype)
        return None

    def _prepare(self, node: fx.Node) -> None:
        if node.name not in self.plan.slots or not isinstance(node.meta.get("val"), torch.Tensor):
            return
        if not self.plan.slots[node.name].owner:
            return  # a view or an in-place op: it acts on its base, wherever that is
        if node.name not in self.slots:
            self.unplanned[node.name] = (
                "outside the arena: keeping it there would raise the predicted peak"
                if self.plan.slots[node.name].buffer in self.dropped
                else f"no allocation-free out= kernel for {_describe(node)}")
            return
        out = self._view(node)
        if node.op == "call_function" and node.target in _CATS:
            self.steps[node] = self._cat_step(node, out)
            self.planned.append(node.name)
            return
        kernel = self._kernel(node)
        if kernel is not None and not _has_out_kwarg(node):
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

    # -- running ------------------------------------------------------------------------

    def __call__(self, *inputs: Any) -> Any:
        with torch.no_grad():
            if not self.steps:  # no arena: the GraphModule's own code holds no interpreter state
                return self.gm(*inputs)
            return _ArenaInterpreter(self).run(*inputs)


class _ArenaInterpreter(fx.Interpreter):
    def __init__(self, runner: ArenaRunner):
        super().__init__(runner.gm, garbage_collect_values=True)
        self.runner = runner

    def run_node(self, n: fx.Node) -> Any:
        step = self.runner.steps.get(n)
        if step is None:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        return step(args, kwargs)


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
