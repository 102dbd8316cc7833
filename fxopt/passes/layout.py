"""Layout passes for cuDNN's tensor-core convolutions on constant (frozen) weights.

cuDNN runs half-precision convolutions on tensor cores in NHWC, with channel counts that
are multiples of 8 (16 bytes). Two passes arrange that, once, at compile time; the
backend runs both on frozen CUDA graphs. Values are unchanged.

- ``channels_last_weights`` stores each constant 4-d conv weight channels-last. cuDNN
  picks NHWC when the input *or the weight* is channels-last
  (``cudnn_conv_suggest_memory_format``) and its output stays channels-last, so the next
  convolution gets NHWC for free. Inductor's freezing does the same for the
  ``aten.convolution`` nodes it sees (``convert_conv_weights_to_channels_last``), but
  fxopt's fused conv ops are external kernels to Inductor, so their weights stayed NCHW
  and every one of them paid cuDNN's layout transposes.
- ``pad_conv_channels`` zero-pads the input channels of a convolution with fewer than 8
  of them (the RGB stem of every vision model) to 8, in the weight and in the input, for
  small kernels only. The padded channels multiply zeros by zeros, so the sum is
  unchanged. Measured on an H100 (bf16, batch 32, bench/RESULTS.md "Session 3"), padding
  pays for 3x3 stems (mobilenet_v3 63 -> 54 us) but not for resnet50's 7x7 stride-2 stem,
  which it made 1.7x slower (239 -> 410 us, 11% of the network): the 8/3 times larger
  reduction outweighs the better kernel. Hence ``max_kernel_area`` (default 16).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxopt.analysis.shapes import fake_call, record_value
from fxopt.graph_utils import fetch_attr, fresh_attr_name
from fxopt.pass_protocol import Option, Pass, PassResult
from fxopt.provenance import record_replacement
from fxopt.registry import register_pass

#: call targets whose first two arguments are a convolution's input and weight
_CONV_TARGETS: set[Any] = {torch.conv2d, F.conv2d, torch.convolution,
                           torch.ops.aten.convolution.default, torch.ops.aten.conv2d.default}
_FUSED_CONV_OPS = ("conv_bias_relu", "conv_bias_add_relu")
_DTYPES = {"half": (torch.float16, torch.bfloat16), "all": (torch.float16, torch.bfloat16, torch.float32)}
_CHANNEL_MULTIPLE = 8


def _conv_targets() -> set[Any]:
    import fxopt.compile.fused_ops  # noqa: F401 - registers torch.ops.fxopt.*

    fused = {getattr(torch.ops.fxopt, name) for name in _FUSED_CONV_OPS}
    return _CONV_TARGETS | fused | {op.default for op in fused}


class ConstantConvWeightPass(Pass):
    """A pass over 2-d convolutions whose weight is a constant (``get_attr``) tensor on the
    chosen device and dtypes."""

    inference_only = True
    options: ClassVar = {
        "device": Option(str, "cuda", "only weights on this device type are changed"),
        "dtypes": Option(str, "half", "'half' (fp16/bf16, the tensor-core case) or 'all'",
                         choices=tuple(_DTYPES)),
    }

    def convolutions(self, gm: fx.GraphModule) -> Iterator[tuple[fx.Node, fx.Node, torch.Tensor]]:
        """(conv node, weight node, weight tensor) for each convolution this pass may change."""
        targets = _conv_targets()
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target not in targets:
                continue
            weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            if not isinstance(weight, fx.Node) or weight.op != "get_attr":
                continue
            value = fetch_attr(gm, weight.target)
            if (isinstance(value, torch.Tensor) and value.dim() == 4
                    and value.device.type == self.options["device"]
                    and value.dtype in _DTYPES[self.options["dtypes"]]):
                yield node, weight, value


@register_pass
class ChannelsLastWeights(ConstantConvWeightPass):
    """Store constant 4-d convolution weights channels-last (values unchanged)."""

    name = "channels_last_weights"

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        converted: dict[str, str] = {}
        for _, weight, value in self.convolutions(gm):
            if weight.target in converted.values() or value.is_contiguous(memory_format=torch.channels_last):
                continue
            if weight.target not in converted:
                attr = fresh_attr_name(gm, f"{weight.target}_channels_last")
                gm.register_buffer(attr, value.contiguous(memory_format=torch.channels_last))
                converted[weight.target] = attr
            weight.target = converted[weight.target]
            if isinstance(weight.meta.get("val"), torch.Tensor):
                record_value(weight, weight.meta["val"].contiguous(memory_format=torch.channels_last))
        return PassResult(bool(converted), {"weights": len(converted)})


@register_pass
class PadConvChannels(ConstantConvWeightPass):
    """Zero-pad the input channels of ungrouped convolutions with fewer than 8 to 8."""

    name = "pad_conv_channels"
    options: ClassVar = {
        **ConstantConvWeightPass.options,
        "max_kernel_area": Option(int, 16, "pad only kernels of at most this many taps (kh*kw)"),
    }

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        padded = 0
        for conv, weight, value in self.convolutions(gm):
            if len(conv.args) < 2 or value.shape[2] * value.shape[3] > self.options["max_kernel_area"]:
                continue  # input and weight given by keyword, or a kernel too large to pay
            x = conv.args[0]
            # the shapes a capture recorded, no propagation: a graph with an op that has no
            # fake impl must not fail here (the stem's input is nearly always a graph input)
            x_val = x.meta.get("val", x.meta.get("example_value")) if isinstance(x, fx.Node) else None
            channels = value.shape[1]
            if (not isinstance(x_val, torch.Tensor) or x_val.dim() != 4 or x_val.shape[1] != channels
                    or channels >= _CHANNEL_MULTIPLE):  # grouped, unknown, or aligned already
                continue
            extra = [0, 0, 0, 0, 0, _CHANNEL_MULTIPLE - channels]  # F.pad counts from the last dim
            attr = fresh_attr_name(gm, f"{weight.target}_padded")
            gm.register_buffer(attr, F.pad(value, extra).contiguous(memory_format=torch.channels_last))
            graph = gm.graph
            with graph.inserting_before(conv):
                new_weight = graph.get_attr(attr)
                wide = graph.call_function(F.pad, (x, extra))
                wide_cl = graph.call_method("contiguous", (wide,), {"memory_format": torch.channels_last})
            if isinstance(weight.meta.get("val"), torch.Tensor):
                record_value(new_weight, F.pad(weight.meta["val"], extra).contiguous(memory_format=torch.channels_last))
            record_value(wide, fake_call(F.pad, x_val, extra))  # a symbolic batch stays symbolic
            record_value(wide_cl, wide.meta["val"].contiguous(memory_format=torch.channels_last))
            conv.args = (wide_cl, new_weight, *conv.args[2:])
            for node in (new_weight, wide, wide_cl):
                record_replacement(node, [conv], self.name)
            if not weight.users:
                graph.erase_node(weight)
            padded += 1
        return PassResult(padded > 0, {"convolutions": padded})
