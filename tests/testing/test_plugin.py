"""The pytest plugin, exercised the way users meet it: a test file run by pytest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxopt.testing import ZOO, CaseInstance

USER_TESTS = '''
import operator
import pytest
import torch
import fxopt

def add_becomes_sub(gm):
    """A broken user pass: every `a + b` becomes `a - b`."""
    for node in gm.graph.nodes:
        if node.target in (operator.add, torch.add):
            node.target = operator.sub

@pytest.mark.fxopt_tags("residual")
@pytest.mark.fxopt_exclude_tags("large")
@pytest.mark.fxopt_dtypes("float32")
def test_broken(fx_case, check_pass):
    check_pass([add_becomes_sub], fx_case)

@pytest.mark.fxopt_cases("mlp", "attention")
@pytest.mark.fxopt_dtypes("bfloat16")
def test_sound(fx_case, check_pass):
    optimized = check_pass(["cse", "dce"], fx_case)
    assert isinstance(optimized, torch.fx.GraphModule)
    assert fx_case.dtype is torch.bfloat16 and fx_case.rtol == 1e-2
'''


def test_markers_select_cases_and_artifacts_hold_a_runnable_minimized_repro(tmp_path):
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    artifacts = tmp_path / "artifacts"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", str(tmp_path / "test_user.py"),
         f"--fxopt-artifacts={artifacts}"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = result.stdout + result.stderr
    ran = sorted(line.split(" ")[0] for line in result.stdout.splitlines() if line.startswith("test_user.py::"))
    # by tag (residual, not large) and dtype: the residual block and the demo net; by name
    assert ran == sorted([*(f"test_user.py::test_broken[{name}-float32]" for name in ("residual_conv_bn_relu", "demo")),
                          *(f"test_user.py::test_sound[{name}-bfloat16]" for name in ("attention", "mlp"))]), out
    assert "2 failed, 2 passed" in out, out
    assert "EquivalenceError" in out and "first diverging node" in out
    assert "call_function[target=operator.sub]" in out  # the changed node is named

    case_dir = artifacts / "test_broken_residual_conv_bn_relu-float32"
    assert {p.name for p in case_dir.iterdir()} >= {"repro.py", "minimized_graph.py", "diff.txt", "error.txt"}
    diff = (case_dir / "diff.txt").read_text()
    assert "-    add = " in diff and "+    add = " in diff and " - " in diff
    repro = subprocess.run([sys.executable, str(case_dir / "repro.py")], capture_output=True,
                           text=True, cwd=tmp_path, timeout=120)
    assert repro.returncode != 0 and "EquivalenceError" in repro.stderr, repro.stderr
    minimized = (case_dir / "minimized_graph.py").read_text()
    assert minimized.count(" = ") <= 5  # a handful of nodes, from the 10-node block


def test_case_instances_carry_inputs_tolerances_and_shapes():
    instance = ZOO["transformer_block"].instantiate(torch.float16)
    assert isinstance(instance, CaseInstance)
    assert instance.inputs[0].dtype is torch.float16
    assert (instance.rtol, instance.atol) == (1e-3, 1e-3)
    assert all("val" in n.meta for n in instance.gm.graph.nodes if n.op != "output")
    assert instance.gm(*instance.inputs).shape == instance.inputs[0].shape
    with pytest.raises(ValueError, match="does not run in torch.float16"):
        ZOO["demo"].instantiate(torch.float16)


def test_zoo_batchnorm_statistics_are_random():
    bn = ZOO["residual_conv_bn_relu"].model().bn1
    assert bn.running_mean.abs().min() > 0 and not torch.allclose(bn.running_var, torch.ones(16))


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_pass_with_test.py"


def test_the_custom_pass_example_runs_and_shows_the_minimized_bug():
    result = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert "first diverging node: 'mul'" in result.stdout
    assert "minimized from 7 to 4 nodes" in result.stdout


@pytest.mark.slow
def test_the_custom_pass_examples_tests_pass():
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
