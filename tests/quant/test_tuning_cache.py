"""The on-disk cache of int8 tuning results: round trip, misses, a corrupt or unwritable file."""

from __future__ import annotations

import torch

from fxopt.quant import tuning_cache


def test_round_trip_and_misses(tmp_path, monkeypatch):
    monkeypatch.setenv("FXOPT_CACHE_DIR", str(tmp_path / "cache"))
    key = tuning_cache.entry_key("NVIDIA H100|triton 3.6.0|torch 2.11", (1, 11008, 4096, torch.bfloat16, False, None, True))
    assert tuning_cache.lookup(key) is None  # no file yet
    config = {"block_n": 32, "block_k": 256, "num_warps": 4, "num_stages": 4, "split_k": 1, "block_m": 16, "fast_cvt": 0}
    tuning_cache.store(key, "gemm", config)
    assert tuning_cache.cache_path().parent == tmp_path / "cache"
    assert tuning_cache.lookup(key) == ("gemm", config)
    other_gpu = key.replace("H100", "H200")
    other_triton = key.replace("triton 3.6.0", "triton 3.7.0")
    assert tuning_cache.lookup(other_gpu) is None and tuning_cache.lookup(other_triton) is None
    tuning_cache.store(other_gpu, "gemv", {**config, "block_n": 8})
    assert tuning_cache.lookup(key) == ("gemm", config)  # a second entry keeps the first
    assert tuning_cache.lookup(other_gpu)[0] == "gemv"


def test_corrupt_or_unwritable_cache_is_a_miss_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FXOPT_CACHE_DIR", str(tmp_path))
    tuning_cache.cache_path().write_text("{not json")
    assert tuning_cache.lookup("k") is None
    tuning_cache.cache_path().write_text('{"k": ["gemm"]}')  # malformed entry
    assert tuning_cache.lookup("k") is None
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("FXOPT_CACHE_DIR", str(blocker / "sub"))  # a directory under a file
    tuning_cache.store("k", "gemm", {})  # skipped, no exception
    assert tuning_cache.lookup("k") is None
