"""fxopt.optimize over every capture path, the CLI, and packaging."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import fxopt
from fxopt.models import demo_model

REPO = Path(__file__).resolve().parents[2]


def _capture(kind, model, inputs):
    if kind == "symbolic_trace":
        return fx.symbolic_trace(model)
    if kind == "export":
        return torch.export.export(model, inputs).module()
    if kind == "exported_program":
        return torch.export.export(model, inputs)
    if kind == "make_fx":
        return make_fx(model)(*inputs)
    return model  # a plain nn.Module, traced by optimize


@pytest.mark.parametrize("kind", ["symbolic_trace", "export", "exported_program", "make_fx", "module"])
def test_optimize_is_equivalent_on_every_capture_path(kind):
    model, inputs = demo_model()
    captured = _capture(kind, model, inputs)
    gm = fxopt.optimize(captured, passes=["dce", "cse", "constant_fold"], example_inputs=inputs, verify=True)
    assert isinstance(gm, fx.GraphModule)
    for _ in range(3):
        x = torch.randn_like(inputs[0])
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)
    report = fxopt.report_of(gm)
    assert [r.name for r in report.records] == ["dce", "cse", "constant_fold"]
    assert report.find("constant_fold")[0].stats["folded"] >= 1


def test_optimized_graph_is_accepted_by_torch_compile():
    model, inputs = demo_model()
    gm = fxopt.optimize(model, example_inputs=inputs)
    compiled = torch.compile(gm, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)


def test_untraceable_model_gets_a_trace_error_with_advice():
    class DataDependent(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x
            return -x

    with pytest.raises(fxopt.TraceError, match=r"(?s)DataDependent.*control flow.*torch\.export"):
        fxopt.optimize(DataDependent())


def test_optimize_rejects_non_models():
    with pytest.raises(TypeError, match="nn.Module, GraphModule or ExportedProgram"):
        fxopt.optimize(lambda x: x)


def test_report_of_a_plain_graph_module_is_a_clear_key_error():
    with pytest.raises(KeyError, match="has not been through fxopt"):
        fxopt.report_of(fx.symbolic_trace(nn.ReLU()))


def test_inplace_optimize_rewrites_the_given_graph_module():
    model, inputs = demo_model()
    gm = fx.symbolic_trace(model)
    nodes = len(gm.graph.nodes)
    out = fxopt.optimize(gm, example_inputs=inputs, inplace=True)
    assert out is gm and len(gm.graph.nodes) < nodes


def _run_cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "fxopt", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_cli_demo_prints_the_per_pass_table():
    result = _run_cli("demo")
    assert result.returncode == 0, result.stderr
    for name in fxopt.DEFAULT_PIPELINE:
        assert name in result.stdout
    assert "nodes before" in result.stdout and "verified after each pass" in result.stdout


def test_cli_optimize_loads_a_factory_and_reports_errors(tmp_path):
    (tmp_path / "mymodels.py").write_text(
        "import torch.nn as nn\n"
        "def make():\n"
        "    return nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Identity(), nn.ReLU())\n"
    )
    ok = _run_cli("optimize", "mymodels:make", "--input-shape", "2,4", "--passes", "remove_dropout,dce",
                  "--verify", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "remove_dropout" in ok.stdout and "yes" in ok.stdout
    bad = _run_cli("optimize", "mymodels:make", "--input-shape", "2,4", "--passes", "cse,dcee", cwd=tmp_path)
    assert bad.returncode == 2 and "unknown pass 'dcee'" in bad.stderr and "'dce'" in bad.stderr
    shape = _run_cli("optimize", "mymodels:make", "--input-shape", "2,5", cwd=tmp_path)
    assert shape.returncode == 2 and "do not fit the graph" in shape.stderr


def test_wheel_installs_subpackages_inside_the_fxopt_namespace(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
         str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )
    if result.returncode != 0 and "No module named" in result.stderr:
        pytest.fail(f"wheel build needs setuptools/wheel in the environment: {result.stderr}")
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("fxopt-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "fxopt/patterns/__init__.py" in names and "fxopt/visualize/__init__.py" in names
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top_level == {"fxopt"}, top_level
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # the files a non-editable install puts in site-packages
    site = site.resolve()
    assert _subpackages_imported(cwd=tmp_path, pythonpath=site) == [
        site / "fxopt" / "patterns" / "__init__.py", site / "fxopt" / "visualize" / "__init__.py"]


def test_the_installed_fxopt_maps_patterns_and_visualize_from_outside_the_repo(tmp_path):
    """The install this suite runs against (the README's ``pip install -e``, or a plain
    ``pip install``) maps the top-level patterns/ and visualize/ into the fxopt namespace for
    a process started outside the checkout, as on the GPU machine (docs/testing.md)."""
    import fxopt.patterns
    import fxopt.visualize

    here = [Path(fxopt.patterns.__file__).resolve(), Path(fxopt.visualize.__file__).resolve()]
    assert _subpackages_imported(cwd=tmp_path) == here


def _subpackages_imported(cwd: Path, pythonpath: Path | None = None) -> list[Path]:
    """The files ``fxopt.patterns`` and ``fxopt.visualize`` import from in a fresh process
    in ``cwd``, with ``pythonpath`` (only) on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    code = "import fxopt.patterns as p, fxopt.visualize as v; print(p.__file__); print(v.__file__)"
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [Path(line).resolve() for line in result.stdout.splitlines()]
