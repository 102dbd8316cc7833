"""How fxopt stores quantized weights: the symmetric int8/int4 ranges, the int4 packing and
its group size, and the version of each format. A leaf module: the ops
(:mod:`fxopt.quant.ops`), the passes and the Triton kernels all import it, and it imports
none of them.

Why versions: a quantized weight is a plain int8 or uint8 tensor, so nothing in its bytes
says how to decode them. :func:`fxopt.saving.save_program` writes :data:`WEIGHT_FORMATS`
with every program and :func:`fxopt.saving.load_program` converts or refuses a program
whose weights were written in another version. Whoever changes what a format's bytes mean
raises its version here and writes the conversion from the old one, as
:func:`convert_int4` does for int4 packing 1 (or lets loading refuse it).
"""

from __future__ import annotations

import torch
from torch import Tensor

#: ranges of the symmetric schemes: -127..127 (-7..7) keeps zero exactly representable
#: and the range symmetric, so a per-channel (per-group) scale is just absmax / 127 (/ 7)
INT8_SYMMETRIC_MAX = 127
INT4_SYMMETRIC_MAX = 7
#: the int4 group sizes (values per scale along K), largest first: the automatic choice
#: takes the largest one that divides K (fewer scales to read, same kernel)
INT4_GROUP_SIZES = (128, 64, 32)
#: the option value that asks for that automatic choice
AUTO_GROUP_SIZE = 0

#: int8 weights (``[N, K]`` int8, one float32 scale per row or tensor): one version so far
INT8_FORMAT_VERSION = 1
#: int4 packing. 1: byte ``j`` of a row held elements ``j`` and ``j + K/2`` of the row
#: (fxopt before 2026-11-26); 2: the pairs lie within a group (:func:`pack_int4`)
INT4_FORMAT_VERSION = 2
#: what a saved program records of the weights it holds, format name -> version
WEIGHT_FORMATS = {"int8": INT8_FORMAT_VERSION, "int4": INT4_FORMAT_VERSION}


def int4_group_size(k: int, requested: int = AUTO_GROUP_SIZE) -> tuple[int | None, str | None]:
    """``(group size, None)`` for an int4 weight with ``k`` values per row, or ``(None, why
    not)``: the requested size where it divides ``k``, or with ``requested`` 0 the largest
    of :data:`INT4_GROUP_SIZES` that does. The quantize pass and quantization-aware training
    both ask this, so a weight gets the same groups in both."""
    if requested != AUTO_GROUP_SIZE:
        if k % requested:
            return None, f"int4_weight_only needs K a multiple of group_size={requested}, K={k}"
        return requested, None
    for size in INT4_GROUP_SIZES:
        if k % size == 0:
            return size, None
    return None, (f"int4_weight_only needs K a multiple of one of {', '.join(map(str, INT4_GROUP_SIZES))}, "
                  f"K={k}")


def pack_int4(w: Tensor, group_size: int, scales: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Symmetric int4 (-7..7) per group of ``group_size`` along K of a ``[N, K]`` weight.

    Returns ``(packed, scales)``: ``packed`` is ``[N, K/2]`` uint8. Within each group, byte
    ``j`` holds the group's element ``j`` in its low nibble and element ``j + group_size/2``
    in its high nibble, each offset by 8: a kernel unpacks a group's bytes into its two
    halves with a mask and a shift, both under the group's one scale. ``scales`` is
    ``[N, K/group_size]`` float32. K must be a multiple of ``group_size``
    (:func:`int4_group_size`). ``scales`` given (learned in quantization-aware training)
    are used instead of each group's ``absmax / 7``.
    """
    n, k = w.shape
    groups = w.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    if scales is None:
        scales = torch.clamp(groups.abs().amax(-1) / INT4_SYMMETRIC_MAX, min=torch.finfo(torch.float32).eps)
    scales = scales.detach().to(torch.float32).reshape(n, k // group_size)
    q = torch.clamp(torch.round(groups / scales[..., None]), -INT4_SYMMETRIC_MAX, INT4_SYMMETRIC_MAX)
    return _pair_within_groups((q + 8).to(torch.uint8).reshape(n, k), group_size), scales


def _pair_within_groups(u: Tensor, group_size: int) -> Tensor:
    """``[N, K]`` uint8 nibbles (0..15) packed as :func:`pack_int4` lays them out."""
    n, k = u.shape
    groups = u.reshape(n, k // group_size, group_size)
    half = group_size // 2
    return (groups[..., :half] | (groups[..., half:] << 4)).reshape(n, k // 2).contiguous()


def convert_int4(packed: Tensor, group_size: int, version: int) -> Tensor:
    """``packed``, written with int4 packing ``version``, in the current packing
    (:data:`INT4_FORMAT_VERSION`). The nibbles only move: the scales stay as they are.
    Raises ``ValueError`` for a version with no conversion."""
    if version == INT4_FORMAT_VERSION:
        return packed
    if version != 1:
        raise ValueError(f"no conversion from int4 packing version {version} to {INT4_FORMAT_VERSION}")
    nibbles = torch.cat([packed & 15, packed >> 4], dim=-1)  # version 1: the row's two halves
    return _pair_within_groups(nibbles, group_size)


def unpack_int4(packed: Tensor, scales: Tensor, group_size: int) -> Tensor:
    """The float32 ``[N, K]`` weight that ``pack_int4`` encoded."""
    n = packed.shape[0]
    grouped = packed.reshape(n, -1, group_size // 2)
    u = torch.cat([grouped & 15, grouped >> 4], dim=-1).reshape(n, -1).to(torch.float32) - 8
    return u * scales.repeat_interleave(group_size, dim=-1)
