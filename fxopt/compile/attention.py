"""``defer_sdpa_choice``: attention whose sizes are symbolic picks its kernel when it runs.

``F.scaled_dot_product_attention`` chooses a kernel (flash, memory-efficient, cuDNN, or the
math fallback) from the sizes, strides, dtypes and mask of each call. Under
``torch.compile`` that choice is made once, while AOTAutograd traces the graph, and with a
symbolic size (a sequence length after Dynamo's automatic dynamic shapes, or
``dynamic=True``) the fused kernels' alignment checks cannot be proven: the graph gets the
math decomposition. For half-precision inputs that decomposition upcasts to fp32 and runs
the two attention matrix products on CUDA cores. Measured on an H100-class GPU (Hugging
Face ``BertModel``, batch 8, sequence 384, bf16, Dynamo's automatic dynamic route): 2.5 ms
of a 4.1 ms call was that fp32 attention, and the same model compiled for the static
length ran a call in 0.74 ms at length 128 where the symbolic graph took 1.22 ms.

This pass replaces each such call with ``torch.ops.fxopt.sdpa``, an opaque op that calls
``F.scaled_dot_product_attention`` at run time, with the call's real sizes: the kernel is
the one eager PyTorch picks for them. One layout is changed first: a mask broadcast along
the key axis (stride 0 there, as ``mask[..., None].expand(...)`` makes it; Hugging Face's
encoders build their padding mask so) is copied dense, since every fused kernel requires
the mask's last stride to be 1 and eager would take the math path too (measured on BERT:
with the mask as built, the op ran fp32 math; the copy is B x L x S bools). Inductor compiles
everything around the op. Results equal eager's up to the kernel's rounding, not the fp32
decomposition's; the op returns one fixed layout (``[B, L, H, E]``
in memory, viewed as ``[B, H, L, E]``: what the fused kernels write), declared by its fake
implementation, so that compiled code reading the output by strides reads it right.

Only calls with a symbolic size are replaced (with static sizes Inductor's choice at
compile time is the one eager makes), only in inference graphs (the op has no backward),
and never with ``dropout_p`` other than zero (a random draw would move out of Inductor's
view of the RNG).
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

from fxopt.analysis.ops import declare_op
from fxopt.analysis.shapes import record_value
from fxopt.pass_protocol import Option, Pass, PassResult
from fxopt.provenance import record_replacement
from fxopt.registry import register_pass

_LIB = torch.library.Library("fxopt", "FRAGMENT")
_LIB.define("sdpa(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float dropout_p, bool is_causal, "
            "float? scale, bool enable_gqa) -> Tensor")
declare_op("fxopt::sdpa", pure=True)  # the same declaration users make for their ops


def _output_layout(q: Tensor, v: Tensor) -> tuple[tuple, tuple]:
    """The output's shape and the op's fixed strides for it: heads-major view of
    ``[B, L, H, E]`` memory for 4-d inputs, contiguous otherwise."""
    shape = (*q.shape[:-1], v.shape[-1])
    if len(shape) == 4:
        _, heads, length, e = shape
        return shape, (length * heads * e, e, heads * e, 1)
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step = step * n
    return shape, tuple(reversed(strides))


def _same_layout(t: Tensor, strides: tuple) -> bool:
    """Equal strides on every dimension longer than 1 (a size-1 dimension's stride is never
    used to address an element)."""
    return all(n == 1 or have == want for n, have, want in zip(t.shape, t.stride(), strides, strict=True))


def dense_key_axis(mask: Tensor | None) -> Tensor | None:
    """``mask`` with a last (key) stride of 1: a copy where it is broadcast along that axis
    (every fused kernel requires it), else ``mask`` itself; other broadcast axes (heads,
    batch) stay views, as the kernels take those."""
    if mask is None or mask.dim() == 0 or mask.shape[-1] == 1 or mask.stride(-1) == 1:
        return mask
    return mask.contiguous()


@torch.library.impl(_LIB, "sdpa", "CompositeExplicitAutograd")
def sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float, is_causal: bool,
         scale: float | None, enable_gqa: bool) -> Tensor:
    """``F.scaled_dot_product_attention``, its kernel chosen now, in the fixed layout."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_key_axis(attn_mask), dropout_p=dropout_p,
                                         is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    shape, strides = _output_layout(q, v)
    if _same_layout(out, strides):
        return out
    return out.new_empty_strided(shape, strides).copy_(out)


@torch.library.register_fake("fxopt::sdpa", lib=_LIB)
def _sdpa_fake(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float, is_causal: bool,
               scale: float | None, enable_gqa: bool) -> Tensor:
    return q.new_empty_strided(*_output_layout(q, v))


_SDPA_TARGETS = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
_SIGNATURE = inspect.Signature([
    inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
    for name, default in (("query", inspect.Parameter.empty), ("key", inspect.Parameter.empty),
                          ("value", inspect.Parameter.empty), ("attn_mask", None), ("dropout_p", 0.0),
                          ("is_causal", False), ("scale", None), ("enable_gqa", False))
])


def _traced(arg: Any) -> Any:
    """The value capture recorded for a node argument (``meta['val']``, else Dynamo's
    ``example_value``), or the argument itself."""
    if isinstance(arg, fx.Node):
        return arg.meta.get("val", arg.meta.get("example_value"))
    return arg


def _symbolic(value: Any) -> bool:
    return isinstance(value, Tensor) and not all(isinstance(n, int) for n in value.shape)


@register_pass
class DeferSdpaChoice(Pass):
    """Let attention with symbolic sizes choose its kernel at run time (torch.ops.fxopt.sdpa)
    instead of the fp32 math decomposition compiled code falls back to."""

    name = "defer_sdpa_choice"
    inference_only = True
    options: ClassVar = {
        "symbolic_only": Option(bool, True, "replace only calls with a symbolic size (with static sizes "
                                            "the compiler's choice is eager's)"),
    }

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        replaced = 0
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target not in _SDPA_TARGETS:
                continue
            try:
                bound = _SIGNATURE.bind(*node.args, **node.kwargs)
            except TypeError:
                continue  # a call this torch would reject anyway: left for it to report
            bound.apply_defaults()
            args = bound.arguments
            if args["dropout_p"] != 0.0 or any(isinstance(args[k], fx.Node)
                                                 for k in ("dropout_p", "is_causal", "scale", "enable_gqa")):
                continue
            values = [_traced(args[k]) for k in ("query", "key", "value", "attn_mask")]
            if not all(isinstance(v, Tensor) for v in values[:3]):
                continue  # no recorded values: nothing says the sizes are symbolic
            if self.options["symbolic_only"] and not any(_symbolic(v) for v in values):
                continue
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(torch.ops.fxopt.sdpa.default, tuple(args.values()))
            value = _traced(node)
            if isinstance(value, Tensor):
                record_value(new, _sdpa_fake(*values, *list(args.values())[4:]))
            node.replace_all_uses_with(new)
            record_replacement(new, [node], self.name)
            gm.graph.erase_node(node)
            replaced += 1
        return PassResult(replaced > 0, {"replaced": replaced})
