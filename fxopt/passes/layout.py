"""``channels_last_weights``: constant conv weights stored channels-last for cuDNN.

Why a pass: cuDNN runs half-precision convolutions on tensor cores in NHWC, and picks
NHWC when the input *or the weight* is channels-last (``cudnn_conv_suggest_memory_format``);
the output then stays channels-last, so the next convolution gets NHWC for free. Inductor's
freezing does the same for the ``aten.convolution`` nodes it sees
(``convert_conv_weights_to_channels_last``), but fxopt's fused conv ops
(``torch.ops.fxopt.conv_bias_relu`` ...) are external kernels to Inductor, so their weights
stayed NCHW and every fused convolution paid cuDNN's internal layout transposes. This
pass stores every constant 4-d conv weight channels-last once, at compile time; the
backend runs it on frozen CUDA graphs. Values are unchanged bit for bit: only strides move.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxopt.analysis.shapes import record_value
from fxopt.graph_utils import fetch_attr, fresh_attr_name
from fxopt.pass_protocol import Option, Pass, PassResult
from fxopt.registry import register_pass

#: call targets whose second argument (``weight``) is a convolution weight
_CONV_TARGETS: set[Any] = {torch.conv2d, F.conv2d, torch.convolution,
                           torch.ops.aten.convolution.default, torch.ops.aten.conv2d.default}
_FUSED_CONV_OPS = ("conv_bias_relu", "conv_bias_add_relu")
_DTYPES = {"half": (torch.float16, torch.bfloat16), "all": (torch.float16, torch.bfloat16, torch.float32)}


def _conv_targets() -> set[Any]:
    import fxopt.fused_ops  # noqa: F401 - registers torch.ops.fxopt.*

    fused = {getattr(torch.ops.fxopt, name) for name in _FUSED_CONV_OPS}
    return _CONV_TARGETS | fused | {op.default for op in fused}


@register_pass
class ChannelsLastWeights(Pass):
    """Store constant 4-d convolution weights channels-last (values unchanged)."""

    name = "channels_last_weights"
    inference_only = True
    options = {
        "device": Option(str, "cuda", "only weights on this device type are converted"),
        "dtypes": Option(str, "half", "'half' (fp16/bf16, where NHWC is cuDNN's fast path) or 'all'",
                         choices=tuple(_DTYPES)),
    }

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        targets = _conv_targets()
        converted: dict[str, str] = {}
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target not in targets:
                continue
            weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            if not isinstance(weight, fx.Node) or weight.op != "get_attr" or weight.target in converted.values():
                continue
            value = fetch_attr(gm, weight.target)
            if not self._wants(value):
                continue
            if weight.target not in converted:
                attr = fresh_attr_name(gm, f"{weight.target}_channels_last")
                gm.register_buffer(attr, value.contiguous(memory_format=torch.channels_last))
                converted[weight.target] = attr
            weight.target = converted[weight.target]
            if isinstance(weight.meta.get("val"), torch.Tensor):
                record_value(weight, weight.meta["val"].contiguous(memory_format=torch.channels_last))
        return PassResult(bool(converted), {"weights": len(converted)})

    def _wants(self, value: Any) -> bool:
        return (isinstance(value, torch.Tensor) and value.dim() == 4
                and value.device.type == self.options["device"]
                and value.dtype in _DTYPES[self.options["dtypes"]]
                and not value.is_contiguous(memory_format=torch.channels_last))
