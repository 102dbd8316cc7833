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
the one eager PyTorch picks for them. Inductor compiles everything around the op. Results
equal eager's up to the kernel's rounding, not the fp32 decomposition's; the op returns one
fixed layout (``[B, L, H, E]`` in memory, viewed as ``[B, H, L, E]``: what the fused kernels
write), declared by its fake implementation, so that compiled code reading the output by
strides reads it right.

A mask constant along the key axis (stride 0 there, as ``mask[..., None].expand(...)``
makes it, or one key column) says, per query row, "attend to every key" or "to none": its
rows are the mask. Every fused kernel requires a mask's last stride to be 1, so eager runs
such a mask on the math path, in fp32 for half-precision inputs (measured on BERT, whose
encoder was built so). A dense copy (B x L x S) would let the fused kernels run, but on CUDA
the memory-efficient kernel does not give a query row with no key the math path's zeros (a
GPU run of the tests measured gradients 30x further from fp32 than eager's). So the op runs
such a mask as what it is: attention with no mask (flash, where eager would have run the
fp32 math), then the math path's result per row: a row that attends to nothing is zero; a
float mask adds one constant to the row's scores, which softmax cancels (``-inf``: the row is
zero; ``+inf`` or NaN: NaN, as the math path gives). No copy is made and nothing is saved
for it. A float mask that needs its own gradient keeps the general path (its gradient is
per element), as do masks with any other layout, which the op copies dense when the kernels
need it.

The op has a backward (``torch.library.register_autograd``), so training graphs are rewritten
too: AOTAutograd, which runs after this torch-level pass, traces the op's formula into the
joint graph, where it calls ``torch.ops.fxopt.sdpa_backward``, again opaque. That op runs
SDPA's forward again on the saved inputs under autograd and takes its gradient, so at run
time both passes are the fused kernels eager picks for the real sizes (on CUDA the flash or
memory-efficient backward). What is saved for backward is the op's inputs (q, k, v, mask),
which the projections' graph mostly holds anyway; eager SDPA saves those plus its output and
the log-sum-exp, so the op saves less, and pays for it with a second attention forward in
the backward.

Only calls with a symbolic size are replaced (with static sizes Inductor's choice at
compile time is the one eager makes), and never with ``dropout_p`` other than zero. Eager's
fused kernels save the RNG seed and offset of their dropout draw and the backward draws the
same mask again from them; the backward here recomputes the forward with a fresh draw, whose
mask would differ from the one the output was computed with, and an inference call would
move the draw out of Inductor's view of the RNG. The op's autograd formula refuses dropout
as well, for callers other than this pass.
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
# the gradients of the inputs ``needs`` flags (q, k, v, attn_mask), in that order
_LIB.define("sdpa_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float dropout_p, "
            "bool is_causal, float? scale, bool enable_gqa, bool[] needs) -> Tensor[]")
declare_op("fxopt::sdpa", pure=True)  # the same declaration users make for their ops
declare_op("fxopt::sdpa_backward", pure=True)


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


def query_rows(mask: Tensor | None, is_causal: bool) -> Tensor | None:
    """The mask's one key column (``[..., L, 1]``) where it is constant along the key axis
    (stride 0 there, or a single column), else None: such a mask says per query row whether
    the row attends to every key or to none (module docstring). With ``is_causal`` the mask
    goes to SDPA, which refuses the pair as eager does."""
    if mask is None or mask.dim() == 0 or is_causal or (mask.shape[-1] > 1 and mask.stride(-1) != 0):
        return None
    return mask.narrow(-1, 0, 1)


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, is_causal: bool,
            scale: float | None, enable_gqa: bool, *, mask_grad: bool = False) -> Tensor:
    """Eager SDPA's result, through the fused kernel eager would pick, or better: a mask
    constant along the key axis runs as no mask plus the math path's per-row result, unless
    its own gradient is wanted (that gradient is per element)."""
    rows = None if mask_grad else query_rows(mask, is_causal)
    if rows is None:
        if mask is not None and mask.dim() > 0 and mask.shape[-1] > 1 and mask.stride(-1) != 1:
            mask = mask.contiguous()  # every fused kernel needs a dense key axis
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)
    if rows.dtype == torch.bool:
        return out.masked_fill(~rows, 0)  # a row with no key to attend to: the math path's zeros
    # a float row adds one constant to its scores, which softmax cancels: finite adds 0, +inf
    # and NaN give NaN, -inf (no key) gives 0, each as the math path does
    return (out + (rows * 0).to(out.dtype)).masked_fill(rows == float("-inf"), 0)


@torch.library.impl(_LIB, "sdpa", "CompositeExplicitAutograd")
def sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float, is_causal: bool,
         scale: float | None, enable_gqa: bool) -> Tensor:
    """``F.scaled_dot_product_attention``, its kernel chosen now, in the fixed layout."""
    out = _attend(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    shape, strides = _output_layout(q, v)
    if _same_layout(out, strides):
        return out
    return out.new_empty_strided(shape, strides).copy_(out)


@torch.library.register_fake("fxopt::sdpa", lib=_LIB)
def _sdpa_fake(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float, is_causal: bool,
               scale: float | None, enable_gqa: bool) -> Tensor:
    return q.new_empty_strided(*_output_layout(q, v))


def _grad_strides(x: Tensor) -> tuple:
    """The strides the gradient of ``x`` is returned with: ``torch.empty_like``'s for ``x``
    (``x``'s own where it is dense, as q, k and v from a projection are; contiguous for a
    broadcast mask), computed on the meta device, which allocates nothing."""
    return torch.empty_like(x, device="meta").stride()


@torch.library.impl(_LIB, "sdpa_backward", "CompositeExplicitAutograd")
def sdpa_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float,
                  is_causal: bool, scale: float | None, enable_gqa: bool, needs: list[bool]) -> list[Tensor]:
    """The gradients of ``fxopt.sdpa`` for the inputs ``needs`` flags: SDPA's forward again on
    the same inputs, under autograd, then its backward, each the kernel eager picks now."""
    leaves = [t if t is None else t.detach().requires_grad_(n) for t, n in zip((q, k, v, attn_mask), needs,
                                                                                strict=True)]
    wanted = [t for t, n in zip(leaves, needs, strict=True) if n]
    with torch.enable_grad():
        out = _attend(*leaves, dropout_p, is_causal, scale, enable_gqa, mask_grad=needs[3])
        grads = torch.autograd.grad(out, wanted, grad)
    result = []
    for g, x in zip(grads, wanted, strict=True):
        strides = _grad_strides(x)
        result.append(g if _same_layout(g, strides) else g.new_empty_strided(x.shape, strides).copy_(g))
    return result


@torch.library.register_fake("fxopt::sdpa_backward", lib=_LIB)
def _sdpa_backward_fake(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float,
                        is_causal: bool, scale: float | None, enable_gqa: bool, needs: list[bool]) -> list[Tensor]:
    return [torch.empty_like(x) for x, n in zip((q, k, v, attn_mask), needs, strict=True) if n]


def _setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
    q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa = inputs
    if dropout_p != 0.0:  # see the module docstring: a recomputed forward would draw another mask
        raise NotImplementedError("fxopt.sdpa has no backward for dropout_p > 0: its backward recomputes the "
                                  "forward, which cannot draw the same dropout mask again")
    ctx.save_for_backward(q, k, v, attn_mask)
    ctx.options = (dropout_p, is_causal, scale, enable_gqa)


def _backward(ctx: Any, grad: Tensor) -> tuple:
    needs = list(ctx.needs_input_grad[:4])
    grads = iter(torch.ops.fxopt.sdpa_backward(grad, *ctx.saved_tensors, *ctx.options, needs))
    return (*(next(grads) if n else None for n in needs), None, None, None, None)


torch.library.register_autograd("fxopt::sdpa", _backward, setup_context=_setup_context, lib=_LIB)


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
            # dropout: the op's backward cannot draw the forward's mask again (module docstring)
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
