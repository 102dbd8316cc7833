"""``pad_group_width``: grouped convolutions with a group width cuDNN handles badly get a
wider one, of zeros.

regnet's grouped 3x3 convolutions have 24 channels per group. On an H200 (bf16, batch 32,
channels-last), cuDNN runs them as a layout transform of the input, the grouped kernel and
a transform back: ``tensorTransformGeneric`` alone was 47% of regnet_y_1_6gf's GPU time,
under fxopt and every Inductor mode alike. The same convolutions with each group's channels
zero-padded to 32 need no transform: 0.56 ms per model call against 2.76 ms
(bench/grouped_conv_probe.py), and with this pass regnet's GPU time per call fell from
3.92 ms (Inductor's reduce-overhead + freezing) to 2.36 ms (bench/gpu_zoo.py --profile).

The rewrite, on a frozen graph (the weight is a constant): the weight gets zero input
channels and zero output filters up to the next multiple of 32 per group (the bias zeros), the
input is padded per group (``unflatten`` to ``[N, groups, width, H, W]``, ``F.pad``,
``flatten``, channels-last), and the output is cut back per group the same way. The extra
channels multiply zeros, so the values are the convolution's (up to the kernel's rounding);
the pad and the cut are pointwise copies that Inductor fuses into the neighbouring kernels.
They are stock torch ops in the graph, not a helper function: the CUDA-graph replay runs
only graphs whose every node fxopt knows to be pure.

Whether it pays depends on the GPU, cuDNN and the shape, so it is decided by timing: at
compile time, on the first graph with that convolution, the padded form (with its pad and
cut as separate copies, the case where Inductor fuses neither) against the plain one, on
random inputs of the graph's shapes, and kept per GPU name and shape for the process
(:func:`decisions`). Each form is timed as a CUDA-graph replay
(:func:`fxopt.compile.timing.replay_time_ms`), in alternating rounds. Timed as eager
launches instead, two H200 runs of the same commit ran regnet at 4.08 and 2.41 ms a call:
the first had kept most convolutions as they were (4.08 ms is the unpadded graph's time).
The likely cause: while Inductor's workers keep the host busy, the padded form's several
ops are charged the host's gaps between them, which the compiled, replayed model does not
have. A graph compiled for varying batch sizes is rewritten as well, timed at the batch it
was traced with (padding channels holds for every batch); a symbolic channel or spatial size
is left alone, as are depthwise convolutions (one channel per group: 32 times the work).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

from fxopt.analysis.shapes import fake_call, record_value
from fxopt.compile.timing import Choices, Timer, replay_time_ms
from fxopt.graph_utils import fetch_attr, fresh_attr_name
from fxopt.pass_protocol import Option, PassResult
from fxopt.passes.layout import ConstantConvWeightPass
from fxopt.provenance import record_replacement
from fxopt.registry import register_pass

_CL = torch.channels_last
#: convolution targets whose arguments 0-5 are input, weight, bias, stride, padding and
#: dilation, and whose output is one convolution's, ReLU'd or not (fused conv+add ops take a
#: second operand the output's width would have to match)
_PLAIN_TARGETS: set[Any] = {torch.conv2d, F.conv2d, torch.ops.aten.conv2d.default, torch.convolution,
                            torch.ops.aten.convolution.default}


def _targets() -> set[Any]:
    import fxopt.compile.fused_ops  # noqa: F401 - registers torch.ops.fxopt.*

    fused = torch.ops.fxopt.conv_bias_relu
    return _PLAIN_TARGETS | {fused, fused.default}


_CHOICES = Choices()


def decisions() -> dict[tuple, bool]:
    """Every decision made in this process, by :func:`decision_key`: whether to pad."""
    return {key: made == "padded" for key, made in _CHOICES.made().items()}


def padded_width(width: int, multiple: int) -> int:
    return -(-width // multiple) * multiple


def pad_groups(t: Tensor, groups: int, width: int, dim: int) -> Tensor:
    """``t`` with each of its ``groups`` slices along ``dim`` zero-padded to ``width``."""
    split = torch.unflatten(t, dim, (groups, t.shape[dim] // groups))
    pad = [0, 0] * (split.dim() - dim - 2) + [0, width - split.shape[dim + 1]]
    return torch.flatten(F.pad(split, pad), dim, dim + 1)


def cut_groups(t: Tensor, groups: int, width: int) -> Tensor:
    """The first ``width`` channels of each of the ``groups`` slices of ``t``'s dim 1."""
    split = torch.unflatten(t, 1, (groups, t.shape[1] // groups))
    return torch.flatten(torch.narrow(split, 2, 0, width), 1, 2)


def decision_key(x: Tensor, weight: Tensor, stride: Any, padding: Any, dilation: Any, multiple: int) -> tuple:
    """The GPU (by name: a decision holds for every GPU of the kind), the shapes, dtype and
    geometry."""
    machine = torch.cuda.get_device_name(x.device) if x.device.type == "cuda" else x.device.type
    return (machine, tuple(x.shape), tuple(weight.shape), x.dtype,
            str(stride), str(padding), str(dilation), multiple)


def timing_shape(x: Tensor) -> tuple[int, ...] | None:
    """The sizes to time a convolution of input ``x`` at: its own, where a graph compiled for
    varying batch sizes has a symbolic batch, the size it was traced with (the symbol's hint:
    the rewrite itself holds for every batch, as it pads and cuts channels only). None where
    a channel or spatial size is symbolic, or the batch has no hint."""
    batch, *rest = x.shape
    if not all(isinstance(n, int) for n in rest):
        return None
    if not isinstance(batch, int):
        batch = getattr(getattr(batch, "node", None), "hint", None)
    return None if batch is None else (int(batch), *rest)


def _traced(node: Any) -> Any:
    return node.meta.get("val", node.meta.get("example_value")) if isinstance(node, fx.Node) else None


@register_pass
class PadGroupWidth(ConstantConvWeightPass):
    """Zero-pad each group of a grouped convolution to a multiple of 32 channels where that
    runs faster on this GPU (decided by timing, once per GPU and shape)."""

    name = "pad_group_width"
    options: ClassVar = {
        **ConstantConvWeightPass.options,
        "multiple": Option(int, 32, "pad each group's channels up to a multiple of this"),
        "decide": Option(str, "time", "'time' (pad where measured faster), 'always' or 'never'",
                         choices=("time", "always", "never")),
    }

    def __init__(self, timer: Timer = replay_time_ms, **options: Any) -> None:
        super().__init__(**options)
        self.timer = timer

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        padded = 0
        for conv, weight, value in self.convolutions(gm):
            plan = self._plan(gm, conv, value)
            if plan is not None and self._pays(conv, value, *plan):
                self._rewrite(gm, conv, weight, value, *plan)
                padded += 1
        return PassResult(padded > 0, {"convolutions": padded})

    def _plan(self, gm: fx.GraphModule, conv: fx.Node, value: Tensor) -> tuple | None:
        """(groups, padded width, input value, bias value) for a convolution this pass can
        widen, else None."""
        if conv.target not in _targets() or len(conv.args) < 2 or conv.kwargs or value.shape[2:] == (1, 1):
            return None
        if conv.target in (torch.convolution, torch.ops.aten.convolution.default) and conv.args[6:7] != (False,):
            return None  # transposed, or given by keyword
        x_val = _traced(conv.args[0])
        if not (isinstance(x_val, Tensor) and x_val.dim() == 4 and timing_shape(x_val) is not None):
            return None
        width, out = value.shape[1], value.shape[0]
        groups = x_val.shape[1] // width
        wide = padded_width(width, self.options["multiple"])
        if groups < 2 or width < 8 or wide == width or out % groups or out // groups != width:
            return None  # ungrouped, depthwise-like, aligned already, or unequal in and out widths
        bias = conv.args[2] if len(conv.args) > 2 else None
        if bias is None:
            return groups, wide, x_val, None
        bias_val = fetch_attr(gm, bias.target) if isinstance(bias, fx.Node) and bias.op == "get_attr" else None
        return (groups, wide, x_val, bias_val) if isinstance(bias_val, Tensor) else None

    def _conv_args(self, conv: fx.Node) -> tuple:
        return tuple(conv.args[3:6]) + (None,) * (3 - len(conv.args[3:6]))

    def _pays(self, conv: fx.Node, value: Tensor, groups: int, wide: int, x_val: Tensor, bias: Tensor | None) -> bool:
        decide = self.options["decide"]
        if decide != "time":
            return decide == "always"
        if value.is_cuda and torch.cuda.is_current_stream_capturing():
            return False  # timing would break the caller's capture: the graph stays as it is
        stride, padding, dilation = (a if a is not None else d for a, d in zip(self._conv_args(conv), (1, 0, 1)))
        x = torch.randn(timing_shape(x_val), device=value.device, dtype=value.dtype).contiguous(memory_format=_CL)
        w_wide = pad_groups(pad_groups(value, groups, wide, 0), 1, wide, 1).contiguous(memory_format=_CL)
        key = decision_key(x, value, stride, padding, dilation, self.options["multiple"])

        def plain() -> Tensor:
            return F.conv2d(x, value, bias, stride, padding, dilation, groups)

        def padded() -> Tensor:
            x_wide = pad_groups(x, groups, wide, 1).contiguous(memory_format=_CL)
            y = F.conv2d(x_wide, w_wide, None, stride, padding, dilation, groups)
            return cut_groups(y, groups, value.shape[1]).contiguous(memory_format=_CL)

        with torch.no_grad():  # the plain form wins a tie
            return _CHOICES.choose(key, {"plain": plain, "padded": padded}, value.device, self.timer) == "padded"

    def _rewrite(self, gm: fx.GraphModule, conv: fx.Node, weight: fx.Node, value: Tensor, groups: int, wide: int,
                 x_val: Tensor, bias: Tensor | None) -> None:
        graph, width = gm.graph, value.shape[1]
        made: list[fx.Node] = []

        def add(target: Any, *args: Any, **kwargs: Any) -> fx.Node:
            """A node of a stock torch op (a string: a tensor method), its value recorded:
            plain ops, so the replay and the other analyses know them."""
            node = (graph.call_method(target, args, kwargs) if isinstance(target, str)
                    else graph.call_function(target, args, kwargs))
            values, kw_values = fx.map_arg((args, kwargs), _traced)
            if isinstance(values[0], Tensor):
                fn = getattr(torch.Tensor, target) if isinstance(target, str) else target
                record_value(node, fake_call(fn, *values, **kw_values))
            made.append(node)
            return node

        def regroup(t: fx.Node, per_group: int, keep: int) -> fx.Node:
            """``t``'s channels as ``groups`` groups of ``per_group``, each padded or cut to
            ``keep``, channels-last again."""
            split = add(torch.unflatten, t, 1, (groups, per_group))
            fitted = (add(F.pad, split, [0, 0, 0, 0, 0, keep - per_group]) if keep > per_group
                      else add(torch.narrow, split, 2, 0, keep))
            return add("contiguous", add(torch.flatten, fitted, 1, 2), memory_format=_CL)

        w_attr = fresh_attr_name(gm, f"{weight.target}_group_padded")
        gm.register_buffer(w_attr, pad_groups(pad_groups(value, groups, wide, 0), 1, wide, 1).contiguous(
            memory_format=_CL))
        old_bias = conv.args[2] if len(conv.args) > 2 else None
        with graph.inserting_before(conv):
            new_weight = graph.get_attr(w_attr)
            made.append(new_weight)
            record_value(new_weight, fetch_attr(gm, w_attr))
            x_wide = regroup(conv.args[0], width, wide)
            new_bias = None
            if bias is not None:
                b_attr = fresh_attr_name(gm, f"{old_bias.target}_group_padded")
                gm.register_buffer(b_attr, pad_groups(bias, groups, wide, 0))
                new_bias = graph.get_attr(b_attr)
                made.append(new_bias)
                record_value(new_bias, fetch_attr(gm, b_attr))
        out_val = _traced(conv)
        conv.args = (x_wide, new_weight, new_bias, *conv.args[3:])
        if isinstance(out_val, Tensor):
            record_value(conv, fake_call(lambda v: pad_groups(v, groups, wide, 1).contiguous(memory_format=_CL),
                                         out_val))
        users = list(conv.users)
        with graph.inserting_before(conv.next):  # after conv, in order
            cut = regroup(conv, wide, width)
        for user in users:
            user.replace_input_with(conv, cut)
        for node in made:
            record_replacement(node, [conv], self.name)
        for old in (weight, old_bias):
            if isinstance(old, fx.Node) and not old.users:
                graph.erase_node(old)
