"""The stock rules: conv/linear + BatchNorm folding and the fusions into ``torch.ops.fxopt``.

Written with the public API (:func:`fxopt.patterns.rule`, :func:`register_rules`), and
spelled once each: the canonical forms make ``aten.convolution`` in a pattern match
``nn.Conv1d/2d/3d`` and ``nn.ConvTranspose*`` modules, ``F.conv2d``, ``torch.conv2d``
and ``aten.conv2d`` alike (module parameters, get_attr nodes and placeholders, as
Dynamo and export deliver them), and ``F.batch_norm`` match modules, ``aten.batch_norm``
and ``getitem(aten._native_batch_norm_legit_no_training(...), 0)``.

Folding computes the new weight and bias *in the graph* (``fold_weight`` /
``fold_bias``), from the original tensors, which are never written: a weight shared by
two convolutions gets two folded copies and stays intact, and a graph whose
parameters are placeholders (Dynamo) stays correct. ``fold_conv_bn`` then evaluates
those computations ahead of time where their inputs are constants (constant_fold).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fxopt.patterns.constraints import equals, is_tensor, rank
from fxopt.patterns.rules import register_rules, rule

import fxopt.compile.fused_ops  # noqa: F401 - registers torch.ops.fxopt.*
from fxopt.analysis.ops import declare_op
from fxopt.analysis.shapes import value_device

aten = torch.ops.aten
fxops = torch.ops.fxopt


# --- folding arithmetic: leaf calls in the graph, since gamma/beta/bias may be None --------

def bn_scale(gamma: torch.Tensor | None, var: torch.Tensor, eps: float) -> torch.Tensor:
    """The per-channel factor BatchNorm multiplies by: gamma / sqrt(var + eps), in float32."""
    scale = torch.rsqrt(var.float() + eps)
    return scale if gamma is None else scale * gamma.float()


def fold_weight(weight: torch.Tensor, gamma: torch.Tensor | None, var: torch.Tensor, eps: float,
                channel_dim: int) -> torch.Tensor:
    """``weight`` scaled per output channel (dim ``channel_dim``) by gamma / sqrt(var + eps):
    a new tensor, computed in float32 and cast back."""
    shape = [1] * weight.dim()
    shape[channel_dim] = -1
    return (weight.float() * bn_scale(gamma, var, eps).reshape(shape)).to(weight.dtype)


def fold_bias(bias: torch.Tensor | None, gamma: torch.Tensor | None, beta: torch.Tensor | None,
              mean: torch.Tensor, var: torch.Tensor, eps: float, dtype_of: torch.Tensor) -> torch.Tensor:
    """(bias - mean) * gamma / sqrt(var + eps) + beta, in the dtype of ``dtype_of``."""
    centered = -mean.float() if bias is None else bias.float() - mean.float()
    folded = centered * bn_scale(gamma, var, eps)
    if beta is not None:
        folded = folded + beta.float()
    return folded.to(dtype_of.dtype)


# leaf calls in the graph (wrapped), declared pure with the same API users have, so that
# constant_fold and dce may treat them like any torch op. torch.fx.wrap only registers the
# names: fxopt's pattern tracer reads that registry and patches nothing (patterns/tracing.py)
for _fold in (fold_weight, fold_bias):
    torch.fx.wrap(_fold.__name__)
    declare_op(_fold, pure=True)


# --- fold_conv_bn ----------------------------------------------------------------------------

def conv_bn(x, w, b, stride, padding, dilation, output_padding, groups, gamma, beta, mean, var,
            momentum, eps):
    y = aten.convolution.default(x, w, b, stride, padding, dilation, False, output_padding, groups)
    return F.batch_norm(y, mean, var, gamma, beta, False, momentum, eps)


def conv_bn_folded(x, w, b, stride, padding, dilation, output_padding, groups, gamma, beta, mean,
                   var, eps):
    return aten.convolution.default(
        x, fold_weight(w, gamma, var, eps, 0), fold_bias(b, gamma, beta, mean, var, eps, w),
        stride, padding, dilation, False, output_padding, groups)


def conv_transpose_bn(x, w, b, stride, padding, dilation, output_padding, groups, gamma, beta,
                      mean, var, momentum, eps):
    y = aten.convolution.default(x, w, b, stride, padding, dilation, True, output_padding, groups)
    return F.batch_norm(y, mean, var, gamma, beta, False, momentum, eps)


def conv_transpose_bn_folded(x, w, b, stride, padding, dilation, output_padding, groups, gamma,
                             beta, mean, var, eps):
    # a transposed conv's weight is (in, out / groups, ...): output channels on dim 1
    return aten.convolution.default(
        x, fold_weight(w, gamma, var, eps, 1), fold_bias(b, gamma, beta, mean, var, eps, w),
        stride, padding, dilation, True, output_padding, groups)


def linear_bn(x, w, b, gamma, beta, mean, var, momentum, eps):
    return F.batch_norm(F.linear(x, w, b), mean, var, gamma, beta, False, momentum, eps)


def linear_bn_folded(x, w, b, gamma, beta, mean, var, eps):
    return F.linear(x, fold_weight(w, gamma, var, eps, 0), fold_bias(b, gamma, beta, mean, var, eps, w))


FOLD_RULES = (
    rule(conv_bn, conv_bn_folded, name="conv_bn"),
    # with groups, output channels interleave across the weight's first two dims
    rule(conv_transpose_bn, conv_transpose_bn_folded, name="conv_transpose_bn", groups=equals(1)),
    # BatchNorm1d normalizes dim 1: the linear's features only for (N, C) inputs
    rule(linear_bn, linear_bn_folded, name="linear_bn", x=rank(2)),
)

register_rules(
    "fold_conv_bn", FOLD_RULES,
    "Fold eval-mode BatchNorm into the preceding Conv1d/2d/3d, ConvTranspose (groups=1) or "
    "Linear (2-d input); new weights are new tensors, and a conv whose output is used "
    "elsewhere is left alone.",
    inference_only=True, fold_constants=True, needs_fake_values=False)


# --- fuse_conv_bn_relu -----------------------------------------------------------------------

def conv_relu(x, w, b, stride, padding, dilation, output_padding, groups):
    return torch.relu(aten.convolution.default(x, w, b, stride, padding, dilation, False,
                                               output_padding, groups))


def conv_relu_fused(x, w, b, stride, padding, dilation, groups):
    return fxops.conv_bias_relu(x, w, b, stride, padding, dilation, groups)


def conv_add_relu(x, w, b, stride, padding, dilation, output_padding, groups, z):
    y = aten.convolution.default(x, w, b, stride, padding, dilation, False, output_padding, groups)
    return torch.relu(y + z)


def conv_add_relu_fused(x, w, b, stride, padding, dilation, groups, z):
    return fxops.conv_bias_add_relu(x, w, b, z, 1.0, stride, padding, dilation, groups)


def conv_bn_relu(x, w, b, stride, padding, dilation, output_padding, groups, gamma, beta, mean,
                 var, momentum, eps):
    return torch.relu(conv_bn(x, w, b, stride, padding, dilation, output_padding, groups, gamma,
                              beta, mean, var, momentum, eps))


def conv_bn_relu_fused(x, w, b, stride, padding, dilation, groups, gamma, beta, mean, var, eps):
    return fxops.conv_bias_relu(x, fold_weight(w, gamma, var, eps, 0),
                                fold_bias(b, gamma, beta, mean, var, eps, w),
                                stride, padding, dilation, groups)


def conv_bn_add_relu(x, w, b, stride, padding, dilation, output_padding, groups, gamma, beta,
                     mean, var, momentum, eps, z):
    return torch.relu(conv_bn(x, w, b, stride, padding, dilation, output_padding, groups, gamma,
                              beta, mean, var, momentum, eps) + z)


def conv_bn_add_relu_fused(x, w, b, stride, padding, dilation, groups, gamma, beta, mean, var,
                           eps, z):
    return fxops.conv_bias_add_relu(x, fold_weight(w, gamma, var, eps, 0),
                                    fold_bias(b, gamma, beta, mean, var, eps, w), z, 1.0,
                                    stride, padding, dilation, groups)


def _residual_fits(m) -> bool:
    """The residual is a tensor of the convolution's own shape and dtype (what the fused
    kernel adds in place); without shapes, only a tensor is required."""
    total = next(g for p, g in m.nodes.items() if m.pattern.canon[p].op == "add")
    z, out_val = m.value("z"), total.meta.get("val")
    if isinstance(z, torch.Tensor) and isinstance(out_val, torch.Tensor):
        return z.shape == out_val.shape and z.dtype == out_val.dtype
    return is_tensor(z)


FUSE_CONV_RULES = (
    rule(conv_bn_add_relu, conv_bn_add_relu_fused, name="conv_bn_add_relu", where=_residual_fits),
    rule(conv_add_relu, conv_add_relu_fused, name="conv_add_relu", where=_residual_fits),
    rule(conv_bn_relu, conv_bn_relu_fused, name="conv_bn_relu"),
    rule(conv_relu, conv_relu_fused, name="conv_relu"),
)

register_rules(
    "fuse_conv_bn_relu", FUSE_CONV_RULES,
    "Fuse conv(+BN)(+residual add)+ReLU into one op: cuDNN's fused conv+bias(+add)+ReLU on "
    "CUDA, the ReLU in place elsewhere.",
    inference_only=True, fold_constants=True, after=("fold_conv_bn",), needs_fake_values=False)


# --- fuse_add_relu, fuse_linear_relu -------------------------------------------------------

def add_relu(a, b):
    return torch.relu(a + b)


def add_relu_fused(a, b):
    return fxops.add_relu(a, b)


register_rules(
    "fuse_add_relu", [rule(add_relu, add_relu_fused, name="add_relu", a=is_tensor, b=is_tensor)],
    "Fuse relu(a + b) of two tensors into one op (one Triton kernel on CUDA, an in-place "
    "ReLU elsewhere).",
    inference_only=True, after=("fuse_conv_bn_relu",), needs_fake_values=False)


def linear_relu(x, w, b):
    return torch.relu(F.linear(x, w, b))


def linear_relu_fused(x, w, b):
    return fxops.linear_relu(x, w, b)


register_rules(
    "fuse_linear_relu", [rule(linear_relu, linear_relu_fused, name="linear_relu")],
    "Fuse relu(linear(x)) into one op (a cuBLASLt GEMM with a ReLU epilogue on CUDA).",
    inference_only=True, needs_fake_values=False)


# --- fuse_linear_gelu ------------------------------------------------------------------------

def linear_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b))  # exact GELU: approximate="none" is a literal that must match


def linear_gelu_fused(x, w, b):
    return fxops.linear_gelu(x, w, b)


def _linear_on_cuda_half(m) -> bool:
    """The linear's value (``meta['val']``) is a CUDA fp16/bf16 tensor: where the fused
    GEMM may win (fxopt.compile.gemm_gelu times it against cuBLAS + GELU). Elsewhere the graph is
    left as it was, so that CPU Inductor keeps its own fusion; without shapes nothing is
    known and nothing fires."""
    linear = next(g for p, g in m.nodes.items() if p in m.pattern.canon and m.pattern.canon[p].op == "linear")
    val = linear.meta.get("val")
    return (isinstance(val, torch.Tensor) and val.dtype in (torch.float16, torch.bfloat16)
            and value_device(linear).type == "cuda")


register_rules(
    "fuse_linear_gelu",
    [rule(linear_gelu, linear_gelu_fused, name="linear_gelu", where=_linear_on_cuda_half)],
    "Fuse gelu(linear(x)) with exact GELU on CUDA fp16/bf16 into one op: a Triton GEMM with "
    "the GELU in its epilogue where it times faster than cuBLAS + a GELU kernel.",
    inference_only=True, needs_fake_values=False)
