"""How the int8 kernels' configuration is chosen (fxopt.quant.int8_configs), on CPU: the
on-disk cache beats the shipped table, which beats the choice by shape; nothing is timed
unless tuning was asked for; the shipped table is package data, and the converter from a
tuning cache feeds it."""

from __future__ import annotations

import dataclasses
import importlib.resources
import importlib.util
import json
import logging
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch

from fxopt.quant import int8_configs, tuning_cache
from fxopt.quant.int8_configs import candidates, choose, heuristic

ROOT = Path(__file__).resolve().parents[2]
MACHINE = "NVIDIA H100 80GB HBM3|triton 3.6.0|torch 2.11.0"
#: M = 1, the down projection of a Llama MLP: weight [4096, 11008], bf16, no bias, any kernel
KEY = (1, 4096, 11008, torch.bfloat16, False, None, False)
FOUND = candidates(1)
SHIPPED = int8_configs.shipped_defaults  # the fixture below replaces it


def no_timing(candidate, reps):
    raise AssertionError(f"timed {candidate} although tuning is off")


@pytest.fixture(autouse=True)
def _clean(tmp_path, monkeypatch):
    """An empty cache directory, tuning left to the environment, which does not ask for it,
    and an empty shipped table unless a test sets one."""
    monkeypatch.setenv("FXOPT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(int8_configs.TUNE_ENV, raising=False)
    monkeypatch.setattr(int8_configs, "_tuning", None)
    monkeypatch.setattr(int8_configs, "shipped_defaults", dict)


def use_table(monkeypatch, table: dict) -> None:
    monkeypatch.setattr(int8_configs, "shipped_defaults", lambda: table)


def entry(candidate) -> list:
    return [candidate[0], dataclasses.asdict(candidate[1])]


def three_others():
    """Three distinct candidates of KEY, none of them the choice by shape."""
    by_shape = heuristic(KEY, FOUND)
    return [c for c in FOUND if c != by_shape][:3]


def test_cache_beats_table_beats_heuristic(monkeypatch):
    cached, shipped, other_family = three_others()
    use_table(monkeypatch, {tuning_cache.entry_key("sm90", KEY): entry(shipped),
                            tuning_cache.entry_key("sm80", KEY): entry(other_family)})
    tuning_cache.store(tuning_cache.entry_key(MACHINE, KEY), *entry(cached))
    assert choose(KEY, FOUND, MACHINE, "sm90", no_timing) == cached
    # another machine (same family: an H100 of another SKU, or other software) has no cache entry
    assert choose(KEY, FOUND, "NVIDIA H100 PCIe|triton 3.6.0|torch 2.11.0", "sm90", no_timing) == shipped
    # a family without a table entry for this shape: the choice by shape
    assert choose(KEY, FOUND, "NVIDIA B200|triton 3.6.0|torch 2.11.0", "sm100", no_timing) == heuristic(KEY, FOUND)
    # other shapes of the same family are not answered by this entry
    wide = (1, 11008, 4096, torch.bfloat16, False, None, False)
    assert choose(wide, FOUND, MACHINE, "sm90", no_timing) == heuristic(wide, FOUND)


def test_cpu_tensors_read_neither_cache_nor_table_through_the_kernels_caller(monkeypatch):
    """``triton_kernels.tuned_config``, which routes each call (CPU tensors: Triton's
    interpreter), on CPU tensors with tuning on and a cache and a table that would answer:
    neither is read, nothing is timed, the choice is by shape. Needs triton importable (the
    test extra installs it); nothing is launched."""
    triton_kernels = pytest.importorskip("fxopt.quant.triton_kernels")
    read = []
    monkeypatch.setattr(tuning_cache, "lookup", lambda key: read.append(("cache", key)))
    monkeypatch.setattr(int8_configs, "shipped_defaults", lambda: read.append(("table",)) or {})
    monkeypatch.setattr(int8_configs, "tune", no_timing)
    monkeypatch.setenv(int8_configs.TUNE_ENV, "1")
    monkeypatch.setattr(triton_kernels, "_TUNED", {})
    x, w = torch.randn(1, 256, dtype=torch.bfloat16), torch.randint(-127, 128, (40, 256), dtype=torch.int8)
    got = triton_kernels.tuned_config(x, w, torch.rand(40), None, torch.empty(1, 40, dtype=torch.bfloat16))
    assert not read
    assert got == heuristic((1, 40, 256, torch.bfloat16, False, None, False), candidates(1))


@pytest.mark.parametrize("bad", [
    ["gemv", {"block_n": 8, "block_k": 1024, "num_warps": 4, "num_stages": 1, "split_k": 5}],  # no such split
    ["gemm", {"block_n": 32, "block_k": 256, "num_warps": 4, "num_stages": 4, "block_m": 128}],  # a large-M tile
    ["gemv", {"block_n": 8, "block_k": 1024, "num_warps": 4, "num_stages": 1, "unroll": 2}],  # unknown field
    ["gemv"],  # malformed
])
def test_entry_that_is_not_a_candidate_is_ignored(monkeypatch, bad):
    use_table(monkeypatch, {tuning_cache.entry_key("sm90", KEY): bad})
    tuning_cache.store(tuning_cache.entry_key(MACHINE, KEY), *(bad if len(bad) == 2 else ["gemv", {}]))
    assert choose(KEY, FOUND, MACHINE, "sm90", no_timing) == heuristic(KEY, FOUND)


def test_an_entry_for_a_forced_kernel_must_be_of_that_kernel(monkeypatch):
    gemm_only = candidates(1, "gemm")
    key = KEY[:5] + ("gemm", False)
    gemv = next(c for c in FOUND if c[0] == "gemv")
    use_table(monkeypatch, {tuning_cache.entry_key("sm90", key): entry(gemv)})
    assert choose(key, gemm_only, MACHINE, "sm90", no_timing)[0] == "gemm"


@pytest.mark.parametrize("env", [None, "0", "", "no"])
def test_nothing_is_timed_unless_tuning_is_on(monkeypatch, env):
    if env is not None:
        monkeypatch.setenv(int8_configs.TUNE_ENV, env)
    assert choose(KEY, FOUND, MACHINE, "sm90", no_timing) in FOUND
    assert not tuning_cache.cache_path().exists()  # nothing tuned, nothing stored


def test_set_int8_tuning_overrides_the_environment(monkeypatch):
    import fxopt.quant as fq

    monkeypatch.setenv(int8_configs.TUNE_ENV, "1")
    fq.set_int8_tuning(False)
    assert choose(KEY, FOUND, MACHINE, "sm90", no_timing) in FOUND
    fq.set_int8_tuning(None)
    assert int8_configs.tuning_enabled()
    monkeypatch.delenv(int8_configs.TUNE_ENV)
    assert not int8_configs.tuning_enabled()
    fq.set_int8_tuning(True)
    assert int8_configs.tuning_enabled()


def test_bad_tuning_switches_are_typed_errors_naming_the_culprit(monkeypatch):
    import fxopt.quant as fq
    from fxopt.errors import InputError

    with pytest.raises(InputError, match="set_int8_tuning.*'1'"):
        fq.set_int8_tuning("1")
    assert int8_configs._tuning is None  # the switch kept its value
    monkeypatch.setenv(int8_configs.TUNE_ENV, "maybe")
    with pytest.raises(InputError, match="FXOPT_INT8_TUNE='maybe'"):
        int8_configs.tuning_enabled()
    monkeypatch.setenv(int8_configs.TUNE_ENV, " Off ")
    assert not int8_configs.tuning_enabled()


@pytest.mark.parametrize("switch", ["env", "function"])
def test_tuning_when_asked_times_candidates_and_caches_the_winner(monkeypatch, switch):
    if switch == "env":
        monkeypatch.setenv(int8_configs.TUNE_ENV, "1")
    else:
        int8_configs.set_int8_tuning(True)
    fastest = FOUND[len(FOUND) // 2]  # neither the first candidate nor the choice by shape
    assert fastest != heuristic(KEY, FOUND)
    cannot_run = FOUND[-1]
    calls = []

    def fake_ms(candidate, reps):
        calls.append((candidate, reps))
        if candidate == cannot_run:
            return None
        return 1.0 if candidate == fastest else 2.0 + FOUND.index(candidate)

    # a table entry does not stop tuning: the user asked for this machine's own winner
    use_table(monkeypatch, {tuning_cache.entry_key("sm90", KEY): entry(FOUND[0])})
    assert choose(KEY, FOUND, MACHINE, "sm90", fake_ms) == fastest
    assert {c for c, _ in calls} == set(FOUND)  # every candidate timed
    assert sum(reps == 100 for _, reps in calls) == 4  # four finalists timed again
    assert tuning_cache.lookup(tuning_cache.entry_key(MACHINE, KEY)) == tuple(entry(fastest))
    # the next process finds it on disk: no timing
    assert choose(KEY, FOUND, MACHINE, "sm90", no_timing) == fastest


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_untimed_choice_says_once_how_to_tune(monkeypatch):
    monkeypatch.setattr(int8_configs, "_hinted", False)
    logger, handler = logging.getLogger(int8_configs.__name__), Records()
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        choose(KEY, FOUND, MACHINE, "sm90", no_timing)
        choose(KEY[:1] + (11008,) + KEY[2:], FOUND, MACHINE, "sm90", no_timing)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    hints = [r for r in handler.records if int8_configs.TUNE_ENV in r.getMessage()]
    assert len(hints) == 1 and hints[0].levelno == logging.INFO
    assert "set_int8_tuning" in hints[0].getMessage()


SHAPES = [(m, n, k, gated, kind)
          for m in (1, 2, 3, 5, 16, 17, 33, 64, 256, 1000, 4096)
          for n, k in ((5, 48), (7, 4096), (33, 100), (4096, 11008), (11008, 4096), (22016, 4096),
                       (128256, 4096))
          for gated in (False, True)
          for kind in (None, "gemv", "gemm")
          if not (kind == "gemv" and m > 16)]


@pytest.mark.parametrize(("m", "n", "k", "gated", "kind"), SHAPES)
def test_heuristic_returns_a_candidate_of_the_right_kernel(m, n, k, gated, kind):
    found = candidates(m, kind, gated)
    if not found:  # a forced GEMV whose rows do not fit its registers
        with pytest.raises(ValueError, match="no int8 kernel configuration"):
            choose((1 << (m - 1).bit_length(), n, k, torch.bfloat16, False, kind, gated), found,
                   None, None, None)
        return
    key = (1 << (m - 1).bit_length(), 2 * n if gated else n, k, torch.bfloat16, False, kind, gated)
    picked = heuristic(key, found)
    assert picked in found
    if kind is not None:
        assert picked[0] == kind
    elif m == 1:  # a tensor-core tile would waste >90% of its rows
        assert picked[0] == "gemv"
    elif key[0] > 256 and int8_configs.LARGE_M_BY_SHAPE == int8_configs.REFERENCE:
        assert picked == (int8_configs.REFERENCE, None)
        return
    elif m > 1:  # on an H100 the GEMM won every shape at M = 2
        assert picked[0] == "gemm"
    # no M tile taller than the rows when a shorter one exists
    heights = {c.block_m for kd, c in found if kd == picked[0]}
    assert picked[1].block_m <= max(key[0], min(heights))


def test_heuristic_splits_k_only_for_narrow_layers():
    narrow = (1, 7, 4096, torch.bfloat16, False, None, False)  # one or two programs
    wide = (1, 4096, 11008, torch.bfloat16, False, None, False)  # hundreds of programs
    short = (1, 7, 48, torch.bfloat16, False, None, False)  # K shorter than two blocks
    assert heuristic(narrow, candidates(1))[1].split_k == 2
    assert heuristic(wide, candidates(1))[1].split_k == 1
    assert heuristic(short, candidates(1))[1].split_k == 1


def test_heuristic_fills_the_gpu_before_growing_the_m_tile():
    """Large M: the tallest M tile (fewest conversions of the weight) among those that still
    make MIN_PROGRAMS programs."""
    key = (256, 4096, 4096, torch.bfloat16, False, None, False)
    kind, config = heuristic(key, candidates(256))
    programs = -(-4096 // config.block_n) * -(-256 // config.block_m)
    assert kind == "gemm" and programs >= int8_configs.MIN_PROGRAMS
    taller = [c for kd, c in candidates(256)
              if kd == "gemm" and c.swap_ab == config.swap_ab and c.block_m > config.block_m]
    assert taller and all(-(-4096 // c.block_n) * -(-256 // c.block_m) < int8_configs.MIN_PROGRAMS
                          for c in taller)


LARGE = (int8_configs.LARGE_M, 4096, 11008, torch.bfloat16, False, None, False)


@pytest.mark.parametrize("bucket", [16, 64, 256, int8_configs.LARGE_M])
def test_heuristic_picks_swap_ab_at_every_m(bucket, monkeypatch):
    """The normal orientation is a candidate for the tuner above 16 rows, never the choice by
    shape (Triton waits for each of its wgmma: int8_configs._GEMM_NORMAL)."""
    monkeypatch.setattr(int8_configs, "LARGE_M_BY_SHAPE", "gemm")
    for gated in (False, True):
        key = (bucket, 2 * 4096 if gated else 4096) + LARGE[2:6] + (gated,)
        found = candidates(bucket, gated=gated)
        kind, config = heuristic(key, found)
        assert kind == "gemm" and config.swap_ab == 1
        assert bucket == 16 or any(kd == "gemm" and not c.swap_ab for kd, c in found)


def test_choice_by_shape_above_256_rows_follows_its_switch(monkeypatch):
    monkeypatch.setattr(int8_configs, "LARGE_M_BY_SHAPE", int8_configs.REFERENCE)
    assert heuristic(LARGE, candidates(int8_configs.LARGE_M)) == (int8_configs.REFERENCE, None)
    assert heuristic(LARGE, candidates(int8_configs.LARGE_M, "gemm"))[0] == "gemm"  # a forced kernel
    key256 = (256,) + LARGE[1:]
    assert heuristic(key256, candidates(256))[0] == "gemm"  # up to 256 rows: fxopt's GEMM


def test_large_m_candidates_keep_their_accumulators_in_registers():
    """Gated tiles hold two accumulators: the tiles whose accumulators would spill (ptxas
    for sm90: 1.1-2.3 KB per thread) are not candidates, in either orientation."""
    for gated, tiles in ((False, 1), (True, 2)):
        large = [c for kd, c in candidates(int8_configs.LARGE_M, gated=gated) if kd == "gemm"]
        assert {c.swap_ab for c in large} == {0, 1}
        assert all(tiles * c.block_m * c.block_n <= 128 * 32 * c.num_warps for c in large)
    plain = {(c.block_m, c.block_n, c.swap_ab) for kd, c in candidates(int8_configs.LARGE_M) if kd == "gemm"}
    gated = {(c.block_m, c.block_n, c.swap_ab) for kd, c in candidates(int8_configs.LARGE_M, gated=True)
             if kd == "gemm"}
    assert (128, 256, 0) in plain and (256, 128, 1) in plain
    assert (128, 256, 0) not in gated and (256, 128, 1) not in gated and (128, 128, 1) in gated


def test_reference_is_a_candidate_above_16_rows_and_loads_from_a_table(monkeypatch):
    reference = (int8_configs.REFERENCE, None)
    assert reference in candidates(64) and reference in candidates(int8_configs.LARGE_M)
    assert reference not in candidates(16) and reference not in candidates(int8_configs.LARGE_M, "gemm")
    assert candidates(1, int8_configs.REFERENCE) == [reference]  # forced, at any M
    found = candidates(int8_configs.LARGE_M)
    use_table(monkeypatch, {tuning_cache.entry_key("sm90", LARGE): ["reference", {}]})
    assert choose(LARGE, found, MACHINE, "sm90", no_timing) == reference
    # with fields, or where it is no candidate (M <= 16), the entry is ignored
    use_table(monkeypatch, {tuning_cache.entry_key("sm90", LARGE): ["reference", {"block_n": 64}],
                            tuning_cache.entry_key("sm90", KEY): ["reference", {}]})
    assert choose(LARGE, found, MACHINE, "sm90", no_timing) == heuristic(LARGE, found)
    assert choose(KEY, FOUND, MACHINE, "sm90", no_timing) == heuristic(KEY, FOUND)


def test_tuned_reference_is_cached_and_read_back(monkeypatch):
    int8_configs.set_int8_tuning(True)
    found = candidates(int8_configs.LARGE_M)
    reference = (int8_configs.REFERENCE, None)
    assert choose(LARGE, found, MACHINE, "sm90", lambda c, reps: 1.0 if c == reference else 2.0) == reference
    assert tuning_cache.lookup(tuning_cache.entry_key(MACHINE, LARGE)) == ("reference", {})
    assert choose(LARGE, found, MACHINE, "sm90", no_timing) == reference


def test_shipped_table_is_package_data_and_valid():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    path = importlib.resources.files("fxopt.quant").joinpath(int8_configs.DEFAULTS_FILE)
    assert path.is_file()
    # a wheel or sdist carries it only if pyproject's package data names it
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(fnmatch(int8_configs.DEFAULTS_FILE, pattern)
               for pattern in data.get("fxopt.quant", []) + data.get("*", []))
    table = json.loads(path.read_text())
    assert table["_source"], "every table entry needs its source"
    SHIPPED.cache_clear()
    assert SHIPPED() == table  # what the lookup reads
    for key, value in table.items():
        if key.startswith("_"):
            continue
        family, bucket, rows, k, dtype, bias, kind, gated = key.split("|")
        assert family.startswith("sm") and dtype.startswith("torch.")
        found = candidates(int(bucket), None if kind == "None" else kind, gated == "True")
        assert int8_configs._as_candidate(value, found) is not None, f"{key} is not a candidate"


def test_gpu_family_is_the_compute_capability():
    assert int8_configs.gpu_family((9, 0)) == "sm90"
    assert int8_configs.gpu_family((8, 6)) == "sm86"


def load_converter():
    spec = importlib.util.spec_from_file_location("int8_defaults_from_cache",
                                                  ROOT / "bench" / "int8_defaults_from_cache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_converter_round_trips_a_tuning_cache(tmp_path, monkeypatch):
    tuned = {(1, 4096, 11008, torch.bfloat16, False, None, False): FOUND[3],
             (16, 22016, 4096, torch.float16, True, None, True): candidates(16, None, True)[5]}
    for key, candidate in tuned.items():  # written by the tuning cache itself
        tuning_cache.store(tuning_cache.entry_key(MACHINE, key), *entry(candidate))
    tuning_cache.store(tuning_cache.entry_key("Weird|GPU|triton 3.6.0|torch 2.11.0", (2, 8, 64, torch.float32, False, "gemv", False)),
                       *entry(candidates(2, "gemv")[0]))
    table = tmp_path / "table.json"
    kept = {"_source": ["earlier"], "sm80|1|5|48|torch.float32|False|None|False": entry(FOUND[0]),
            tuning_cache.entry_key("sm90", (1, 4096, 11008, torch.bfloat16, False, None, False)): entry(FOUND[0])}
    table.write_text(json.dumps(kept))
    load_converter().main([str(tuning_cache.cache_path()), "--family", "sm90", "--table", str(table)])

    merged = json.loads(table.read_text())
    assert merged["sm80|1|5|48|torch.float32|False|None|False"] == entry(FOUND[0])  # other entries kept
    assert len(merged["_source"]) == 2 and merged["_source"][0] == "earlier"
    assert "NVIDIA H100 80GB HBM3" in merged["_source"][1] and "sm90" in merged["_source"][1]
    assert not any("triton" in key or "H100" in key for key in merged if not key.startswith("_"))
    use_table(monkeypatch, merged)
    for key, candidate in tuned.items():  # the same shape replaced; the lookup finds each
        assert choose(key, candidates(key[0], key[5], key[6]), "another machine", "sm90", no_timing) == candidate
    forced = (2, 8, 64, torch.float32, False, "gemv", False)
    assert choose(forced, candidates(2, "gemv"), "x", "sm90", no_timing) == candidates(2, "gemv")[0]


def test_converter_rejects_a_file_that_is_not_a_tuning_cache(tmp_path):
    converter = load_converter()
    with pytest.raises(ValueError, match="not a tuning cache key"):
        converter.table_entries({"sm90|1|2|3": ["gemv", {}]}, "sm90")


def test_shapes_the_kernels_cannot_take_route_to_the_reference_with_the_reason():
    """The route is decided before any kernel: a weight strided along K, int4 groups the
    kernels cannot read; each says why, and the op's result is the reference's."""
    from fxopt.quant.formats import pack_int4
    from fxopt.quant.ops import int4_weight_only_linear_reference, ops, weight_only_route

    x = torch.randn(3, 64)
    w = torch.randint(-127, 128, (64, 48), dtype=torch.int8).t()  # [48, 64], K stride 48
    assert "weight strides (1, 48)" in weight_only_route(x, w)
    assert "weight strides (128, 2)" in weight_only_route(x, torch.zeros(48, 128, dtype=torch.int8)[:, ::2])
    assert weight_only_route(x, torch.zeros(48, 128, dtype=torch.int8)[:, :64]).startswith("cpu")  # row stride 128
    assert weight_only_route(x, w.contiguous()) == "cpu tensors (the Triton kernels run on CUDA)"
    packed, scales = pack_int4(torch.randn(16, 96), 32)
    x96 = torch.randn(2, 96)
    assert "group size 48 with K = 96" in weight_only_route(x96, packed, 48, scales)
    assert "group size 64 with K = 96" in weight_only_route(x96, packed, 64, scales)
    assert "scale strides" in weight_only_route(x96, packed, 32, scales.t().contiguous().t())
    assert weight_only_route(x96, packed, 32, scales).startswith("cpu tensors")
    torch.testing.assert_close(ops.int4_weight_only_linear(x96, packed, scales, 32, None),
                               int4_weight_only_linear_reference(x96, packed, scales, 32, None))
