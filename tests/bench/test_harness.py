"""The bench harness's own pieces: where records go, the results folder's name, the order of
alternating rounds, a variant that fails, a fresh process that dies, the markdown table."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import harness
import harness.timing
import pytest
import torch
from harness.records import RESULTS


@pytest.mark.parametrize(("name", "slug"), [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-40GB", "a100"),
    ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"), ("cpu", "cpu"), ("Some Accelerator", "some-accelerator"),
])
def test_slug_names_the_gpu_kind(name, slug):
    assert harness.slug(name) == slug


def test_results_folder_counts_gpus():
    assert harness.results_dir("NVIDIA H200", gpus=2) == RESULTS / "h200x2"
    assert harness.results_dir("cpu", gpus=2) == RESULTS / "cpu"


def _args(**kw):
    return argparse.Namespace(**{"smoke": False, "out": None, **kw})


def test_record_goes_to_out_a_folder_or_the_results_folder(tmp_path):
    assert harness.Record("b", _args(out=str(tmp_path)), "cpu").path == tmp_path / "b.json"
    assert harness.Record("b", _args(out=str(tmp_path), smoke=True), "cpu").path == tmp_path / "b.json"
    assert harness.Record("b", _args(out=str(tmp_path / "x.json")), "cpu").path == tmp_path / "x.json"
    assert harness.Record("b", _args(smoke=True), "cpu").path == RESULTS / "cpu" / "b_smoke.json"
    assert harness.Record("b", _args(), "cpu").path == RESULTS / "cpu" / "b.json"


def test_record_rewrites_its_file_on_every_row(tmp_path):
    record = harness.Record("b", _args(out=str(tmp_path / "r.json"), rounds=3), "cpu", note="n")
    record.add({"x": 1})
    first = json.loads((tmp_path / "r.json").read_text())
    assert first["rows"] == [{"x": 1}] and first["meta"]["note"] == "n" and first["meta"]["args"]["rounds"] == 3
    record.add({"x": 2})
    assert len(json.loads((tmp_path / "r.json").read_text())["rows"]) == 2


def test_alternate_interleaves_and_reverses_odd_rounds():
    calls = []
    samples = harness.alternate({"a": "a", "b": "b", "c": "c"}, 3, lambda v: calls.append(v) or len(calls),
                                reverse_odd=True)
    assert calls == list("abccbaabc")
    assert samples == {"a": [1, 6, 7], "b": [2, 5, 8], "c": [3, 4, 9]}


def test_alternate_returns_each_variants_samples_sorted():
    calls = []
    samples = harness.alternate({"a": "a", "b": "b"}, 3, lambda v: calls.append(v) or 10 - len(calls))
    assert calls == list("ababab")
    assert samples == {"a": [5, 7, 9], "b": [4, 6, 8]}


def test_alternate_drops_a_failing_variant_and_says_why():
    failed, tried = [], []

    def measure(v):
        tried.append(v)
        if v == "bad":
            raise RuntimeError("capture failed")
        return 1.0

    samples = harness.alternate({"ok": "ok", "bad": "bad"}, 3, measure, on_error=lambda k, e: failed.append((k, e)))
    assert samples == {"ok": [1.0, 1.0, 1.0]}
    assert tried == ["ok", "bad", "ok", "ok"]  # out of the race after its first failure
    assert [k for k, _ in failed] == ["bad"] and isinstance(failed[0][1], RuntimeError)
    with pytest.raises(RuntimeError):
        harness.alternate({"bad": "bad"}, 1, measure)


def test_fresh_process_reads_back_the_child_json_or_its_error(tmp_path):
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text("import json, sys\nopen(sys.argv[-1], 'w').write(json.dumps({'v': sys.argv[1]}))\n")
    bad.write_text("import sys\nprint('boom', file=sys.stderr)\nsys.exit(3)\n")
    row = harness.fresh_process(good, ["7"], timeout=60)
    assert row["v"] == "7" and row["process_s"] > 0
    assert harness.fresh_process(bad, [], timeout=60) == {"error": "exit 3: boom"}


def test_fresh_process_passes_its_environment_and_keeps_what_a_killed_child_wrote(tmp_path):
    slow = tmp_path / "slow.py"
    slow.write_text("import json, os, sys, time\n"
                    "open(sys.argv[-1], 'w').write(json.dumps({'v': os.environ['FXOPT_BENCH_V']}))\n"
                    "time.sleep(60)\n")
    row = harness.fresh_process(slow, [], timeout=5, env={"FXOPT_BENCH_V": "7"})
    assert row == {"v": "7", "error": "no result within 5 s"}


def test_fresh_process_reports_a_child_that_wrote_and_then_failed_or_ran_out_of_time(tmp_path):
    """A child that wrote its JSON and then exited non-zero is an error, not a row; one that
    outlives the timeout is an error row, never an exception."""
    crashed, slow = tmp_path / "crashed.py", tmp_path / "slow.py"
    crashed.write_text("import json, sys\nopen(sys.argv[-1], 'w').write(json.dumps({'v': 1}))\n"
                       "print('died after writing', file=sys.stderr)\nsys.exit(1)\n")
    slow.write_text("import time\ntime.sleep(60)\n")
    assert harness.fresh_process(crashed, [], timeout=60) == {"error": "exit 1: died after writing"}
    assert harness.fresh_process(slow, [], timeout=1) == {"error": "no result within 1 s"}


class _Clock:
    """A ``perf_counter`` that moves only when the timed function says: each call of ``fn``
    takes the next of ``durations`` (ms), so every timer's figure is known in advance."""

    def __init__(self, durations_ms):
        self.now, self.durations = 0.0, list(durations_ms)

    def perf_counter(self):
        return self.now

    def fn(self):
        self.now += self.durations.pop(0) / 1e3


@pytest.fixture
def clock(monkeypatch):
    def install(*durations_ms):
        fake = _Clock(durations_ms)
        monkeypatch.setattr(harness.timing, "time", SimpleNamespace(perf_counter=fake.perf_counter))
        return fake
    return install


def test_cpu_timers_give_the_median_ms_per_call_and_leave_out_the_warmup(clock):
    """On a CPU clock that advances by the durations given: milliseconds, per call, the
    median (not the mean: one slow sample moves it), warmup calls run but not timed; each
    timer calls the function exactly as often as its arguments say (no duration left over)."""
    c = clock(1, 1, 9, 2, 1)  # call_ms: 5 timed calls, no warmup
    assert harness.call_ms(c.fn, "cpu", reps=5) == pytest.approx(1.0) and not c.durations
    c = clock(50, 50, 50, 1, 1, 2, 2, 9, 9)  # loop_ms: 3 warmup calls, 3 reps of 2 calls
    assert harness.loop_ms(c.fn, "cpu", iters=2, reps=3, warmup=3) == pytest.approx(2.0) and not c.durations
    c = clock(50, 50, 1, 2, 9)  # wall_ms: 2 warmup calls, 3 timed
    assert harness.wall_ms(c.fn, "cpu", reps=3, warmup=2) == pytest.approx(2.0) and not c.durations
    c = clock(1, 2, 9)  # host_ms: 3 timed calls
    assert harness.host_ms(c.fn, "cpu", reps=3) == pytest.approx(2.0) and not c.durations


def test_timers_on_the_cpu_give_positive_medians():
    assert harness.call_ms(lambda: sum(range(100)), "cpu") > 0
    assert harness.loop_ms(lambda: sum(range(100)), "cpu", iters=3, reps=2) > 0
    assert harness.wall_ms(lambda: None, "cpu", reps=3) >= 0
    assert harness.DeviceMemory("cpu").start().stop() == {}  # no device memory to count on a CPU


def test_cpu_threads_are_put_back():
    before = torch.get_num_threads()
    with harness.cpu_threads(before + 1):
        assert torch.get_num_threads() == before + 1
    with harness.cpu_threads(None):
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before


def test_clocked_counts_the_cpu_of_the_work_and_of_the_children_it_waited_for():
    """A sleep is wall time and no CPU; a child's busy loop is CPU the call cost, though
    another process did it (a report's renderer); the result comes back."""
    slept = harness.clocked(lambda: time.sleep(0.2) or "done")
    assert slept.value == "done" and slept.wall_s >= 0.2 and slept.cpu_s < 0.1, slept
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    child = harness.clocked(lambda: subprocess.run([sys.executable, "-c", busy], check=True))
    assert child.cpu_s >= 0.3, child


def test_markdown_table():
    table = harness.markdown_table([{"a": 1.23456, "b": None}, {"a": "x"}], ["a", "b"], digits=2)
    assert table.splitlines() == ["| a | b |", "| --- | --- |", "| 1.23 | - |", "| x | - |"]


def test_environment_names_the_software():
    env = harness.environment("cpu")
    assert env["device"] == "cpu" and env["torch"] and env["python"] == ".".join(map(str, sys.version_info[:3]))
