"""``triton_depthwise``: depthwise convolutions run by fxopt's Triton kernel where it is
measured faster than cuDNN.

A depthwise convolution (one channel per group) is bound by memory traffic, and on an H200
cuDNN's kernel for it ran at about a third of the bandwidth (:mod:`fxopt.compile.depthwise`
says what was measured and how the kernel works). This pass replaces each one, on a graph
whose weights are constants, with ``torch.ops.fxopt.depthwise_conv2d``, an opaque op that
Inductor calls as it calls cuDNN (the bias is added in the kernel; what follows, an
activation, say, Inductor fuses as before).

Which is faster depends on the GPU and the shape, so it is decided by timing, at compile
time, the first time a shape is seen: cuDNN's convolution and each kernel configuration, on
random inputs of the graph's shapes, each as a CUDA-graph replay, in alternating rounds
(:class:`fxopt.compile.timing.Choices`); the winner, cuDNN included, is kept per GPU name
and shape for the process. Graphs with a symbolic size are left alone (no one shape to
time), as are dilated convolutions and calls given by keyword.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

from fxopt.analysis.shapes import record_value
from fxopt.compile import depthwise
from fxopt.compile.timing import Choices, Timer, replay_time_ms
from fxopt.pass_protocol import Option, PassResult
from fxopt.passes.layout import ConstantConvWeightPass
from fxopt.provenance import record_replacement
from fxopt.registry import register_pass

#: convolution targets whose arguments are (input, weight, bias, stride, padding, dilation,
#: groups), and those whose arguments are (..., dilation, transposed, output_padding, groups)
_CONV2D = {torch.conv2d, F.conv2d, torch.ops.aten.conv2d.default}
_CONVOLUTION = {torch.convolution, torch.ops.aten.convolution.default}

_CHOICES = Choices()


def decisions() -> dict[tuple, str]:
    """Every choice made in this process, by :func:`decision_key`: ``"cudnn"`` or the
    index of a kernel configuration (:data:`fxopt.compile.depthwise.CONFIGS`)."""
    return _CHOICES.made()


def decision_key(x: Tensor, weight: Tensor, stride: list[int], padding: list[int]) -> tuple:
    """The GPU (by name: a choice holds for every GPU of the kind), the shapes, dtype and
    geometry."""
    machine = torch.cuda.get_device_name(x.device) if x.device.type == "cuda" else x.device.type
    return machine, tuple(x.shape), tuple(weight.shape), x.dtype, tuple(stride), tuple(padding)


def _pair(value: Any) -> list[int] | None:
    """A stride or padding as two ints, or None where it is not one (``"same"``, a node)."""
    if isinstance(value, int):
        return [value, value]
    if isinstance(value, list | tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return list(value)
    return None


def _output_value(x_val: Tensor, weight: Tensor, stride: list[int], padding: list[int]) -> Tensor:
    """The op's output for the graph's records: made by ``x_val``'s own mode (a fake value
    stays fake), channels-last as the kernel writes it."""
    n, c, h, w = depthwise.output_shape(x_val, weight, stride, padding)
    return x_val.new_empty_strided((n, c, h, w), (h * w * c, 1, w * c, c))


def _traced(node: Any) -> Any:
    return node.meta.get("val", node.meta.get("example_value")) if isinstance(node, fx.Node) else None


@register_pass
class TritonDepthwise(ConstantConvWeightPass):
    """Run depthwise convolutions by fxopt's Triton kernel where that is faster on this GPU
    (decided by timing, once per GPU and shape)."""

    name = "triton_depthwise"
    options: ClassVar = {
        **ConstantConvWeightPass.options,
        "decide": Option(str, "time", "'time' (the faster of cuDNN and the kernel), 'always' (the kernel) "
                                      "or 'never'", choices=("time", "always", "never")),
    }

    def __init__(self, timer: Timer = replay_time_ms, **options: Any) -> None:
        super().__init__(**options)
        self.timer = timer

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        replaced = 0
        for conv, _, value in self.convolutions(gm):
            plan = self._plan(conv, value)
            if plan is None:
                continue
            config = self._choice(value, *plan)
            if config is not None:
                self._rewrite(gm, conv, value, plan, config)
                replaced += 1
        return PassResult(replaced > 0, {"convolutions": replaced})

    def _plan(self, conv: fx.Node, weight: Tensor) -> tuple | None:
        """(input value, input, weight, bias, stride, padding) for a depthwise convolution
        this pass can replace, else None."""
        if conv.kwargs:
            return None
        if conv.target in _CONV2D:
            # the defaults of the arguments after (input, weight)
            x, w, bias, stride, padding, dilation, groups = (*conv.args, *(None, 1, 0, 1, 1)[len(conv.args) - 2:])
        elif conv.target in _CONVOLUTION and len(conv.args) == 9 and conv.args[6] is False:
            x, w, bias, stride, padding, dilation, _, _, groups = conv.args
        else:
            return None  # a fused op, or a transposed convolution
        x_val = _traced(x)
        stride, padding = _pair(stride), _pair(padding)
        if not (isinstance(x_val, Tensor) and x_val.dim() == 4 and all(isinstance(n, int) for n in x_val.shape)):
            return None  # no value, or a symbolic size: no one shape to time
        channels = x_val.shape[1]
        if (stride is None or padding is None or _pair(dilation) != [1, 1] or groups != channels
                or weight.shape[:2] != (channels, 1) or x_val.dtype != weight.dtype):
            return None
        return x_val, x, w, bias, stride, padding

    def _choice(self, weight: Tensor, x_val: Tensor, x: fx.Node, w: fx.Node, bias: Any, stride: list[int],
                padding: list[int]) -> int | None:
        """The kernel configuration to run (an index), or None to keep cuDNN's convolution."""
        decide = self.options["decide"]
        if decide != "time":
            return 0 if decide == "always" else None
        if weight.is_cuda and (torch.cuda.is_current_stream_capturing() or depthwise._kernel() is None):
            return None  # timing would break the caller's capture; no Triton, no kernel
        b = torch.randn(weight.shape[0], device=weight.device, dtype=weight.dtype) if bias is not None else None
        sample = torch.randn(x_val.shape, device=weight.device, dtype=weight.dtype).contiguous(
            memory_format=torch.channels_last)
        channels = weight.shape[0]
        candidates = {"cudnn": lambda: F.conv2d(sample, weight, b, stride, padding, 1, channels)}
        for i, config in enumerate(depthwise.CONFIGS):
            candidates[str(i)] = (lambda config=config: depthwise.run_config(sample, weight, b, stride, padding,
                                                                             config))
        with torch.no_grad():  # cuDNN wins a tie
            made = _CHOICES.choose(decision_key(sample, weight, stride, padding), candidates, weight.device,
                                   self.timer)
        return None if made == "cudnn" else int(made)

    def _rewrite(self, gm: fx.GraphModule, conv: fx.Node, weight: Tensor, plan: tuple, config: int) -> None:
        x_val, x, w, bias, stride, padding = plan
        with gm.graph.inserting_before(conv):
            new = gm.graph.call_function(torch.ops.fxopt.depthwise_conv2d.default,
                                         (x, w, bias, stride, padding, config))
        record_value(new, _output_value(x_val, weight, stride, padding))
        conv.replace_all_uses_with(new)
        record_replacement(new, [conv], self.name)
        gm.graph.erase_node(conv)
