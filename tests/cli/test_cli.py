"""The ``fxopt`` command, run for real in a subprocess on small factories written to a
temporary folder: every kind of model a factory may return, --save read back and compared
with the model on fresh inputs, and every user mistake as one line on stderr, exit code 2."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

FACTORIES = '''
import torch, torch.nn as nn

def module():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 3)).eval()

def graph_module():
    return torch.fx.symbolic_trace(module())

def exported():
    return torch.export.export(module(), (torch.randn(2, 4),))

def exported_module():
    return exported().module()

def raises():
    raise RuntimeError("no weights here")

not_callable = 3

def not_a_model():
    return 42
'''


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "factories.py").write_text(FACTORIES)
    return tmp_path


def fxopt_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fxopt", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def reference(workdir: Path, name: str) -> torch.nn.Module:
    spec = importlib.util.spec_from_file_location("factories_ref", workdir / "factories.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)()


def assert_same_function(saved: torch.nn.Module, model: torch.nn.Module) -> None:
    for _ in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(saved(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("factory", ["module", "graph_module", "exported", "exported_module"])
def test_optimize_takes_every_kind_of_model_and_saves_a_pt2_that_computes_the_same(workdir, factory):
    shape = [] if factory == "exported" else ["--input-shape", "2,4"]  # its own inputs otherwise
    report = ["--report", "r.html"] if factory == "graph_module" else []
    result = fxopt_cli(workdir, "optimize", f"factories.py:{factory}", *shape, "--verify",
                       "--save", "out.pt2", *report)
    assert result.returncode == 0, result.stderr
    assert "fuse_linear_relu" in result.stdout and "saved out.pt2 (torch.export" in result.stdout
    if report:
        assert "<html" in (workdir / "r.html").read_text().lower()
    import fxopt.compile.fused_ops  # noqa: F401 - the saved program calls torch.ops.fxopt.linear_relu

    program = torch.export.load(workdir / "out.pt2")
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "fxopt.linear_relu.default" in targets  # the optimized program, not the original
    assert_same_function(program.module(), reference(workdir, "module"))


def test_save_as_code_writes_readable_code_and_weights_that_load_back(workdir):
    from fxopt.saving import load_program

    result = fxopt_cli(workdir, "optimize", "factories.py:module", "-i", "2,4", "--save", "net",
                       "--save-format", "code", "--quiet")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""  # --quiet
    code = (workdir / "net" / "module.py").read_text()
    assert "torch.ops.fxopt.linear_relu" in code and "def forward" in code
    assert (workdir / "net" / "state_dict.pt").is_file()
    assert_same_function(load_program(workdir / "net"), reference(workdir, "module"))



@pytest.mark.parametrize("fmt", ["code", "pt2"])
def test_a_quantized_program_saved_in_either_format_loads_back(workdir, fmt):
    """quantize drops each Linear's float weight: the saved program still loads, and
    computes what the same quantization computes in process (bitwise: same ops, same tensors)."""
    import fxopt.quant as fq
    from fxopt.saving import load_program

    result = fxopt_cli(workdir, "optimize", "factories.py:module", "-i", "2,4", "-p",
                       "quantize{mode=int8_weight_only}", "--save", "net", "--save-format", fmt)
    assert result.returncode == 0, result.stderr
    saved = load_program(workdir / ("net" if fmt == "code" else "net.pt2"))
    quantized = fq.quantize_model(reference(workdir, "module"), (torch.randn(2, 4),), "int8_weight_only")
    for _ in range(3):
        x = torch.randn(2, 4)
        assert torch.equal(saved(x), quantized(x))

#: each mistake, the command line that makes it, and what the one line must name
MISTAKES = {
    "missing file": (["optimize", "nowhere.py:module", "-i", "2,4"], "no such file"),
    "missing module": (["optimize", "no_such_pkg.models:make", "-i", "2,4"], "no module named"),
    "missing factory": (["optimize", "factories.py:nothing", "-i", "2,4"], "no attribute 'nothing'"),
    "not callable": (["optimize", "factories.py:not_callable", "-i", "2,4"], "not callable"),
    "factory raises": (["optimize", "factories.py:raises", "-i", "2,4"], "no weights here"),
    "not a model": (["optimize", "factories.py:not_a_model", "-i", "2,4"], "returned a int"),
    "bad dtype": (["optimize", "factories.py:module", "-i", "2,4", "--dtype", "foo"], "--dtype"),
    "bad shape": (["optimize", "factories.py:module", "-i", "2,x"], "bad shape '2,x'"),
    "no shape": (["optimize", "factories.py:module"], "--input-shape"),
    "wrong shape": (["optimize", "factories.py:module", "-i", "2,5"], "do not fit the graph"),
    "unknown pass": (["optimize", "factories.py:module", "-i", "2,4", "-p", "cse,dcx"],
                     "unknown pass 'dcx'"),
    "bad pass option": (["optimize", "factories.py:module", "-i", "2,4", "-p", "quantize{mode=foo}"],
                        "option 'mode'"),
    "unknown command": (["optimise"], "invalid choice"),
}
#: run as separate processes (each costs an interpreter and torch); all run in process below
IN_A_SUBPROCESS = ("missing module", "factory raises", "bad dtype", "wrong shape", "unknown pass")


def _assert_one_line_error(code, stderr: str, says: str) -> None:
    assert code == 2
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("fxopt") and "error" in lines[0] and says in lines[0]
    assert "Traceback" not in stderr


@pytest.mark.parametrize("mistake", IN_A_SUBPROCESS)
def test_user_mistakes_are_one_line_and_exit_code_2(workdir, mistake):
    args, says = MISTAKES[mistake]
    result = fxopt_cli(workdir, *args)
    _assert_one_line_error(result.returncode, result.stderr, says)


@pytest.mark.parametrize("mistake", MISTAKES)
def test_user_mistakes_in_process(workdir, mistake, monkeypatch, capsys):
    from fxopt.cli import main

    monkeypatch.chdir(workdir)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the factory module's folder goes on it
    args, says = MISTAKES[mistake]
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse's mistakes
        code = exit_.code
    _assert_one_line_error(code, capsys.readouterr().err, says)


def test_debug_shows_the_traceback(workdir):
    result = fxopt_cli(workdir, "optimize", "factories.py:raises", "-i", "2,4", "--debug")
    assert result.returncode == 2
    assert "Traceback" in result.stderr and "RuntimeError: no weights here" in result.stderr
