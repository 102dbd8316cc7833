"""Functional collectives are effects: a real 2-process gloo program through fxopt.

cse must never merge two collectives, dce must not drop one, and inplace must never
write a buffer a collective still uses before its wait_tensor (rule R16). The same program
trained through ``backend="fxopt"`` keeps its four all_reduces and is never replayed as a
CUDA graph (a replay must issue every collective as the plain step would). A rank that
issues a different sequence of collectives than the other hangs the program, so the
processes run under a timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

WORKER = Path(__file__).with_name("collectives_worker.py")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    tmp = tmp_path_factory.mktemp("gloo")
    init = tmp / "init"
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(init),
                               str(tmp / f"rank{rank}.json")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
             for rank in (0, 1)]
    for p in procs:
        try:
            output, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the ranks hung: they issued different collectives")
        assert p.returncode == 0, output
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("pipeline", ["cleanup", "inplace", "default"])
def test_collectives_are_kept_in_order_and_results_match_eager(reports, pipeline):
    for report in reports:
        assert report[pipeline]["collectives"] == report["before"]
        assert report["before"].count("_c10d_functional.all_reduce.default") == 4
        assert report[pipeline]["equal"]


def test_inplace_never_writes_a_buffer_in_flight(reports):
    for report in reports:
        assert "aten.relu_.default" not in report["inplace"]["inplace_ops"]


def test_a_training_step_through_the_backend_keeps_every_collective_and_is_never_replayed(reports):
    for report in reports:
        training = report["training"]
        assert training["training"] and training["equal"]
        assert training["captured"].count("all_reduce") == 4
        assert training["compiled"] == training["captured"]  # none merged, dropped or moved
        assert "is a collective" in training["no_replay"]
