"""bench/training.py --memory-history: what holds the reserved memory at its peak.

The history itself needs a GPU; what the bench makes of it does not. These tests hand the
analysis a synthetic ``torch.cuda.memory._snapshot()`` trace whose answer is known by
construction, and check which allocations it counts, where it puts the peak, and how it
names who made each allocation.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "training.py"
MB = 1_000_000


@pytest.fixture(scope="module")
def training():
    spec = importlib.util.spec_from_file_location("bench_training", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def frame(path, line, name="f"):
    return {"filename": str(path), "line": line, "name": name}


def test_live_allocations_at_the_first_peak_are_grouped_by_the_fxopt_frame_that_made_them(training, tmp_path):
    core, rules, elsewhere = tmp_path / "fxopt", tmp_path / "patterns", tmp_path / "site" / "fxopt"
    roots = tuple(os.path.join(os.path.realpath(p), "") for p in (core, rules))
    backup = [frame("/torch/_tensor.py", 1, "clone"), frame(core / "snapshot.py", 88, "backup"),
              frame(core / "backend.py", 10, "compile")]  # innermost first: the backup's frame names it
    # not fxopt's although its path holds "/fxopt/"; "<eval_with_key>" is no Python file
    inductor = [frame("<eval_with_key>.3", 5), frame("/torch/_inductor/graph.py", 7), frame(elsewhere / "fake.py", 2),
                frame("/torch/x.py", 1), frame("/torch/y.py", 4)]
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 100 * MB},
        {"action": "alloc", "addr": 1, "size": 40 * MB, "frames": backup},
        {"action": "alloc", "addr": 2, "size": 30 * MB, "frames": inductor},
        {"action": "alloc", "addr": 3, "size": 5 * MB, "frames": [frame(rules / "rules.py", 3, "match")]},
        {"action": "free_requested", "addr": 3, "size": 5 * MB},  # still live until completed
        {"action": "alloc", "addr": 4, "size": 10 * MB, "frames": backup},
        {"action": "free_completed", "addr": 4, "size": 10 * MB},
        {"action": "alloc", "addr": 5, "size": 20 * MB, "frames": backup},
        {"action": "free_completed", "addr": 99, "size": 8 * MB},  # made before the recording
        {"action": "segment_map", "addr": 200, "size": 50 * MB},  # the peak: 150 MB
        {"action": "free_completed", "addr": 1, "size": 40 * MB},
        {"action": "segment_free", "addr": 0, "size": 100 * MB},
        {"action": "segment_alloc", "addr": 300, "size": 100 * MB},  # 150 MB again: not a new peak
        {"action": "alloc", "addr": 6, "size": 7 * MB, "frames": [frame(core / "late.py", 1)]},
    ]
    got = training.peak_live_allocations({"device_traces": [[], trace]}, roots, device=1)
    assert got["events"] == len(trace)
    assert got["peak_reserved_since_start_MB"] == 150
    assert got["allocated_since_start_at_peak_MB"] == 95  # 40 + 30 + 5 + 20
    assert got["top"] == [["snapshot.py:88 backup", 60.0], ["graph.py:7 < fake.py:2 < x.py:1", 30.0],
                          ["rules.py:3 match", 5.0]]


def test_a_history_that_never_reserves_has_no_peak(training):
    trace = [{"action": "alloc", "addr": 1, "size": MB, "frames": []}]
    got = training.peak_live_allocations({"device_traces": [trace]}, ())
    assert (got["peak_reserved_since_start_MB"], got["allocated_since_start_at_peak_MB"], got["top"]) == (0, 0, [])


def test_the_roots_are_where_fxopt_and_its_patterns_run_from(training):
    import fxopt.patterns  # binds fxopt too

    roots = training.fxopt_roots()
    for module in (fxopt, fxopt.patterns):
        assert os.path.realpath(module.__file__).startswith(roots), (module.__file__, roots)
    assert not os.path.realpath(pytest.__file__).startswith(roots)


def test_memory_history_without_a_gpu_is_refused_naming_the_flag():
    done = subprocess.run([sys.executable, str(BENCH), "--smoke", "--memory-history"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--memory-history" in done.stderr and "needs a GPU" in done.stderr
