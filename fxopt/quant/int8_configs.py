"""Launch configurations of the int8 weight-only kernels (:mod:`fxopt.quant.triton_kernels`)
and how one is chosen for a shape: by default without timing anything.

Timing every candidate (what ``tuned_config`` always did) takes 45-60 s per M bucket for a
Llama-shaped MLP stack on an H100 (bench/RESULTS.md), far over a first call's budget of a few
seconds. So the first call of a shape (M bucket, N, K, dtype, bias, kernel choice, gated)
looks, in this order (:func:`choose`):

1. the on-disk tuning cache (:mod:`fxopt.quant.tuning_cache`): this GPU, Triton and torch
   tuned the shape before;
2. only if tuning is on (``FXOPT_INT8_TUNE=1`` or :func:`set_int8_tuning`): every
   candidate is timed (a progress bar shows) and the winner is stored in that cache;
3. the shipped table ``int8_defaults.json``: winners of earlier tuning runs per GPU family
   (compute capability, ``"sm90"`` for H100 and H200: the name string differs between
   SKUs of one chip), used only while its configuration is still among :func:`candidates`;
4. :func:`heuristic`: a configuration picked from the shape alone.

Steps 3 and 4 log once per process, at INFO, how to turn tuning on. This module imports no
triton, so the choice is the same, and testable, on a machine without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fxopt.errors import InputError
from fxopt.progress import progress
from fxopt.quant import tuning_cache

_log = logging.getLogger(__name__)

#: the M buckets (see :func:`m_bucket`): one-row decode, two rows, small batches, and three
#: sizes of prefill; every M above the last shares :data:`LARGE_M` (few buckets: under
#: ``torch.compile`` each bucket a dynamic graph meets is one recompilation)
M_BUCKETS = (1, 2, 16, 64, 256)
LARGE_M = 4096
#: the largest M at which the CUDA-core GEMV is among the candidates (its FMAs grow with M,
#: the tensor-core tile's do not; at M = 4 it was 1.7x slower on an H100)
GEMV_MAX_M = 2
#: the environment variable that turns tuning on ("1")
TUNE_ENV = "FXOPT_INT8_TUNE"
#: its values that turn tuning on, and off (unset counts as off); any other is an error
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
#: the shipped table of defaults, package data of fxopt.quant
DEFAULTS_FILE = "int8_defaults.json"
#: programs below which a layer leaves SMs without work (an H100 has 132, an A100 108): the
#: heuristic then prefers tiles that make more programs, or splits K
MIN_PROGRAMS = 128


@dataclass(frozen=True)
class Config:
    """One launch configuration of ``_gemv`` or ``_gemm``.

    ``split_k`` programs share one tile's K range; ``fast_cvt`` picks the magic-number
    int8 conversion (1) or Triton's plain cast (0); ``block_m`` is the GEMM's tile of
    rows (the GEMV takes all M rows at once); ``swap_ab`` is the GEMM's orientation:
    ``y.T = w @ x.T`` (1, the converted weight is the left ``tl.dot`` operand) or
    ``y = x @ w.T`` (0, the activation is).
    """

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    block_m: int = 16
    fast_cvt: int = 1
    swap_ab: int = 1


#: the kernel name of the weight-only reference (the weight dequantized by one pointwise
#: kernel, then cuBLAS), a candidate above 16 rows (no configuration: ``(REFERENCE, None)``)
REFERENCE = "reference"
#: a kernel ("gemv", "gemm" or :data:`REFERENCE`) and its configuration
Candidate = tuple[str, Config | None]

#: (BLOCK_N, BLOCK_K, warps, stages) of the GEMV and of the GEMM at M <= 16, and
#: (BLOCK_N, BLOCK_M, BLOCK_K, warps, stages) of the GEMM above
_GEMV_TILES = [(8, 1024, 4, 1), (16, 512, 4, 1), (16, 256, 4, 1), (32, 256, 4, 1), (8, 512, 4, 1),
               (4, 1024, 4, 1), (16, 1024, 8, 1), (8, 1024, 4, 3), (16, 512, 4, 3), (8, 512, 4, 3),
               (4, 512, 4, 1), (8, 256, 4, 1)]
_GEMM_SMALL_M = [(32, 256, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 256, 8, 3), (32, 512, 4, 3),
                 (32, 256, 4, 6), (64, 128, 4, 6), (16, 512, 4, 4)]
_GEMM_LARGE_M = [(64, 32, 128, 4, 4), (128, 32, 128, 4, 4), (128, 64, 64, 4, 4), (128, 64, 128, 8, 3),
                 (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
                 (128, 128, 128, 8, 3), (128, 256, 64, 8, 4), (64, 256, 64, 4, 4), (256, 64, 64, 8, 3)]
#: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the GEMM in its normal orientation (swap_ab=0):
#: the tiles of a bf16 GEMM on Hopper, 128-256 rows by 128-256 channels. Candidates for the
#: tuner only, never the choice by shape: compiled for sm90 by Triton 3.6, the normal
#: orientation writes the converted weight tile to shared memory each iteration and waits
#: for each wgmma (``wgmma.wait_group 0`` in the loop), where swap-AB feeds it from registers
#: and keeps 3-15 wgmma groups in flight (every tile here, ptxas on the PTX; no GPU needed)
_GEMM_NORMAL = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4),
                (256, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 128, 64, 4, 4), (64, 256, 64, 8, 3)]
#: the choice by shape above 256 rows (:data:`M_BUCKETS`), for shapes the shipped table lacks:
#: "gemm" (fxopt's swap-AB GEMM) or :data:`REFERENCE`. The reference: the route the last H100
#: measurement of these kernels timed above 256 rows (bench/RESULTS.md's history). Only fp32
#: activations reach it now: :mod:`fxopt.quant.routes` sends bf16/fp16 ones of that size to the
#: two-term product or to dequantize + cuBLAS
LARGE_M_BY_SHAPE = REFERENCE
#: fp32 accumulator values per thread a GEMM tile may hold (its tiles x BLOCK_M x BLOCK_N over
#: 32 x warps threads): above 128 the accumulators spill (ptxas for sm90: every gated tile over
#: it spilled 1.1-2.3 KB per thread, none at or under it)
MAX_ACC_PER_THREAD = 128

_tuning: bool | None = None
_hinted = False


def m_bucket(m: Any) -> int:
    """The M bucket of ``m`` rows: the smallest of :data:`M_BUCKETS` that holds it, or
    :data:`LARGE_M` above them. Configurations are chosen per bucket.

    ``m`` may be a ``torch.SymInt`` (a graph compiled for dynamic M): each comparison then
    guards the compiled graph on M's range, so a dynamic graph holds the configuration of
    one bucket and is recompiled once per bucket it meets, never per M."""
    for bucket in M_BUCKETS:
        if m <= bucket:
            return bucket
    return LARGE_M


def candidates(bucket: int, kind: str | None = None, gated: bool = False) -> list[Candidate]:
    """The (kernel, configuration) pairs tried in M bucket ``bucket``, optionally of one
    kernel only: the GEMV up to :data:`GEMV_MAX_M` rows, the GEMM (swap-AB; above 16 rows also
    in its normal orientation; there, tiles whose accumulators fit :data:`MAX_ACC_PER_THREAD`)
    and, above 16 rows, the :data:`REFERENCE`.

    ``gated`` (the SwiGLU form, two weight tiles per program) takes no K split.
    """
    splits = (1,) if gated else (1, 2)
    tiles = 2 if gated else 1
    found = []
    if kind in (None, "gemv") and (bucket <= GEMV_MAX_M or kind == "gemv"):
        # the fp32 partial sums of the tiles live in registers: keep them to 64 per thread
        found += [("gemv", Config(bn, bk, w, st, split)) for split in splits
                  for bn, bk, w, st in _GEMV_TILES if tiles * bucket * bn * bk <= 64 * 32 * w]
    if kind in (None, "gemm"):
        if bucket <= 16:
            found += [("gemm", Config(bn, bk, w, st, split, 16, cvt)) for split in splits for cvt in (1, 0)
                      for bn, bk, w, st in _GEMM_SMALL_M]
        else:
            by_orientation = [(1, _GEMM_LARGE_M), (0, [(bn, bm, bk, w, st) for bm, bn, bk, w, st in _GEMM_NORMAL])]
            found += [("gemm", Config(bn, bk, w, st, 1, bm, cvt, swap_ab)) for swap_ab, shapes in by_orientation
                      for cvt in (1, 0) for bn, bm, bk, w, st in shapes
                      if tiles * bm * bn <= MAX_ACC_PER_THREAD * 32 * w]
    if kind == REFERENCE or (kind is None and bucket > 16):
        found.append((REFERENCE, None))
    return found


def set_int8_tuning(enabled: bool | None) -> None:
    """Time the int8 kernels' candidates on the first call of each shape (True), or never
    (False), for this process; None restores the default: on only where the environment
    sets ``FXOPT_INT8_TUNE=1``. Tuning takes up to a minute per shape; its winners are
    cached on disk (:func:`fxopt.quant.tuning_cache.cache_path`), so each machine tunes a
    shape once."""
    if enabled is not None and not isinstance(enabled, bool):
        raise InputError(f"set_int8_tuning: expected True, False or None, got {enabled!r}")
    global _tuning
    _tuning = enabled


def tuning_enabled() -> bool:
    """Whether a shape missing from the on-disk cache is tuned (see :func:`set_int8_tuning`)."""
    if _tuning is not None:
        return _tuning
    value = os.environ.get(TUNE_ENV, "").strip().lower()
    if value in _ON or value in _OFF:
        return value in _ON
    raise InputError(f"{TUNE_ENV}={os.environ[TUNE_ENV]!r}: expected one of {', '.join(_ON + _OFF[1:])}")



def gpu_family(capability: tuple[int, int]) -> str:
    """The shipped table's GPU key: the compute capability (``(9, 0)`` -> ``"sm90"``), shared by
    every SKU of a chip whatever its name string."""
    return f"sm{capability[0]}{capability[1]}"


@functools.cache
def shipped_defaults() -> dict[str, Any]:
    """The shipped table: ``tuning_cache.entry_key(family, tuning key)`` -> [kernel, fields]
    (keys starting with ``_`` are notes). A missing or corrupt file counts as empty."""
    try:
        text = importlib.resources.files("fxopt.quant").joinpath(DEFAULTS_FILE).read_text()
        data = json.loads(text)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def choose(key: tuple, found: list[Candidate], machine: str | None, family: str | None,
           time_ms: Callable[[Candidate, int], float | None] | None) -> Candidate:
    """The configuration for tuning key ``key`` (M bucket, weight rows, K, dtype, has bias,
    kernel, gated), one of ``found``, in the order of the module doc.

    ``machine``: the GPU name and software versions that key the on-disk cache; ``family``:
    :func:`gpu_family`; ``time_ms(candidate, reps)``: its median time, None if it cannot run.
    All three None where nothing can be timed (CPU tensors in Triton's interpreter).
    """
    if not found:
        raise ValueError(f"no int8 kernel configuration fits M <= {key[0]} ({key[5] or 'any'} kernel)")
    if machine is not None:
        disk_key = tuning_cache.entry_key(machine, key)
        cached = _as_candidate(tuning_cache.lookup(disk_key), found)
        if cached is not None:
            return cached
        if time_ms is not None and tuning_enabled():
            winner = tune(key, found, time_ms)
            tuning_cache.store(disk_key, winner[0], as_fields(winner[1]))
            return winner
        _hint_once(family)
    shipped = None
    if family is not None:
        shipped = _as_candidate(shipped_defaults().get(tuning_cache.entry_key(family, key)), found)
    return shipped or heuristic(key, found)


def tune(key: tuple, found: list[Candidate], time_ms: Callable[[Candidate, int], float | None]) -> Candidate:
    """The fastest of ``found``: every candidate timed briefly, then the four fastest again
    for longer (a brief timing ranks well but is noisy between close finalists)."""
    _log.info("fxopt: tuning the int8 kernel for M <= %d, N=%d, K=%d, %s: %d candidates "
              "(once per shape on this machine; cached in %s)", key[0], key[1], key[2], key[3],
              len(found), tuning_cache.cache_path())
    times = {}
    for candidate in progress(found, desc=f"tuning int8 kernel M<={key[0]} N={key[1]} K={key[2]}",
                              unit="config", delay=1.0):
        t = time_ms(candidate, 15)
        if t is not None:
            times[candidate] = t
    if not times:
        raise RuntimeError(f"no int8 kernel configuration ran for the tuning key {key}")
    finalists = sorted(times, key=times.get)[:4]
    return min(finalists, key=lambda candidate: time_ms(candidate, 100))


def as_fields(config: Config | None) -> dict[str, int]:
    """A configuration as the fields a cache or table entry stores (none for the reference)."""
    return {} if config is None else dataclasses.asdict(config)


def heuristic(key: tuple, found: list[Candidate]) -> Candidate:
    """A configuration of ``found`` picked from the shape alone, by the reasoning of
    :mod:`fxopt.quant.triton_kernels`: a decode layer is bound by reading its weight, so

    - at M = 1 the CUDA-core GEMV (a tensor-core tile would waste >90% of its rows), at
      larger M the swap-AB GEMM, whose FMAs do not grow with M (on an H100 the GEMM won
      every shape at M = 2, the GEMV the long-K one at M = 1), at every M swap-AB (see
      ``_GEMM_NORMAL`` for why not the normal orientation); above 256 rows fxopt's GEMM or
      the reference, as :data:`LARGE_M_BY_SHAPE` says;
    - enough programs to give every SM loads in flight (:data:`MIN_PROGRAMS`); among the
      tiles that make that many, the tallest M tile not taller than the M bucket (the
      weight is converted once per M tile), then the candidates' own order;
    - when no tile makes that many (few output channels), the one that makes the most, with
      K split in two where K spans two blocks.
    """
    bucket, rows, k, _dtype, _bias, _kind, gated = key
    n = rows // 2 if gated else rows
    kinds = {kind for kind, _ in found}
    if kinds == {REFERENCE} or (LARGE_M_BY_SHAPE == REFERENCE and bucket > M_BUCKETS[-1]
                                and (REFERENCE, None) in found):
        return REFERENCE, None
    kind = "gemv" if "gemv" in kinds and (bucket == 1 or "gemm" not in kinds) else "gemm"
    mine = [config for kd, config in found if kd == kind]
    mine = [config for config in mine if config.swap_ab] or mine
    lowest = min(config.block_m for config in mine)
    whole = [c for c in mine if c.split_k == 1 and c.block_m <= max(bucket, lowest)]

    def programs(config: Config) -> int:
        m_tiles = -(-bucket // config.block_m) if kind == "gemm" else 1
        return -(-n // config.block_n) * m_tiles

    filling = [c for c in whole if programs(c) >= MIN_PROGRAMS]
    if filling:
        tallest = max(c.block_m for c in filling)
        return kind, next(c for c in filling if c.block_m == tallest)
    best = max(whole, key=programs)  # the first of equals
    split = dataclasses.replace(best, split_k=2)
    if split in mine and k >= 2 * best.block_k:
        return kind, split
    return kind, best


def _as_candidate(entry: tuple[str, dict[str, int]] | list | None,
                  found: list[Candidate]) -> Candidate | None:
    """A cache or table entry as a candidate, or None where it is malformed, has the fields
    of an older :class:`Config`, or is no longer among ``found``."""
    if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], dict)):
        return None
    if entry[0] == REFERENCE:
        candidate = REFERENCE, None
        return candidate if candidate in found and not entry[1] else None
    try:
        candidate = entry[0], Config(**entry[1])
    except TypeError:
        return None
    return candidate if candidate in found else None


def _hint_once(family: str | None) -> None:
    global _hinted
    if not _hinted:
        _hinted = True
        _log.info("fxopt: int8 kernels use built-in configurations for this GPU (%s), untimed; "
                  "set %s=1 or call fxopt.quant.set_int8_tuning(True) to time them once per "
                  "shape (up to a minute each; cached in %s)", family, TUNE_ENV,
                  tuning_cache.cache_path())
