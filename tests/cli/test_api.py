"""The API under the command line, in process: help and tables as a user reads them, typed
errors from fxopt.factory, and saving that leaves the optimized GraphModule as it was."""

import re
import shutil

import pytest
import torch
import torch.nn as nn

import fxopt
from fxopt.cli import main
from fxopt.errors import FactoryError, FxoptError, SaveError
from fxopt.factory import build_model
from fxopt.saving import load_program, save_program


def _output_of(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--help"], ["optimize", "--help"], ["passes", "--help"],
                                  ["demo", "--help"]])
def test_help_is_plain_text(argv, capsys):
    text = _output_of(argv, capsys)
    assert "usage: fxopt" in text
    assert not re.search(r"``|:\w+:`", text)  # no reStructuredText markup


def test_version(capsys):
    assert _output_of(["--version"], capsys).startswith(f"fxopt {fxopt.__version__} (torch ")


def test_passes_table_fits_100_columns_and_documents_every_pass_and_option(capsys):
    assert main(["passes"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert max(map(len, lines)) <= 100
    assert "``" not in text
    for name, cls in fxopt.registered_passes().items():
        assert any(line.startswith(name + " ") for line in lines), name
        for key in cls.options:
            assert re.search(rf"^\s+{key}=<", text, re.M), (name, key)


def test_factory_errors_are_typed(tmp_path, monkeypatch):
    (tmp_path / "models.py").write_text(
        "import torch.nn as nn\n"
        "def ok(): return nn.Linear(2, 2)\n"
        "def bad(): raise ValueError('boom')\n"
        "value = 1\n")
    monkeypatch.chdir(tmp_path)
    assert isinstance(build_model("models.py:ok"), nn.Linear)
    assert isinstance(build_model("models:ok"), nn.Linear)
    for spec in ("models.py:bad", "models.py:value", "models.py:missing", "gone.py:ok",
                 "no_such_module_here:ok", "no-colon"):
        with pytest.raises(FactoryError) as info:
            build_model(spec)
        assert isinstance(info.value, FxoptError) and "\n" not in str(info.value)
    with pytest.raises(FactoryError, match="boom") as info:
        build_model("models.py:bad")
    assert isinstance(info.value.__cause__, ValueError)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # annotated: to_folder must cope
        return torch.relu(self.fc(x)) + 1


def test_saving_leaves_the_graph_module_as_it_was_and_both_formats_load_back(tmp_path):
    model = _Net().eval()
    x = torch.randn(3, 4)
    gm = fxopt.optimize(model, example_inputs=(x,))
    code, names = gm.code, [n.name for n in gm.graph.nodes]
    for fmt, expected in (("auto", "pt2"), ("code", "code")):
        where, kind = save_program(gm, tmp_path / fmt, (x,), format=fmt)
        assert kind == expected
        fresh = torch.randn(3, 4)
        torch.testing.assert_close(load_program(where)(fresh), model(fresh))
    assert gm.code == code and [n.name for n in gm.graph.nodes] == names


class _WithSubmodules(nn.Module):
    """A Linear (to_folder writes its repr), a LayerNorm and a GELU (it pickles them to
    NAME.pt) and a buffer (in state_dict.pt)."""

    def __init__(self):
        super().__init__()
        self.fc, self.norm, self.act = nn.Linear(4, 6), nn.LayerNorm(6), nn.GELU()
        self.register_buffer("shift", torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.fc(x))) + self.shift


def test_a_code_folder_loads_after_it_is_moved(tmp_path):
    model = _WithSubmodules().eval()
    x = torch.randn(3, 4)
    gm = fxopt.optimize(model, example_inputs=(x,))
    written, kind = save_program(gm, tmp_path / "here" / "net", (x,), format="code")
    assert kind == "code" and {"norm.pt", "act.pt", "state_dict.pt"} <= {p.name for p in written.iterdir()}
    moved = shutil.copytree(written, tmp_path / "elsewhere" / "copy")
    shutil.rmtree(tmp_path / "here")
    code = (moved / "module.py").read_text()
    assert str(tmp_path) not in code  # no absolute path left
    assert "torch.load(_HERE / 'state_dict.pt', weights_only=True)" in code
    loaded = load_program(moved)
    for _ in range(3):
        fresh = torch.randn(5, 4)  # another batch size than the example's
        torch.testing.assert_close(loaded(fresh), model(fresh), rtol=1e-5, atol=1e-6)


def test_a_tensor_read_under_two_names_stays_one_tensor_in_a_code_folder(tmp_path):
    """The graph increments ``a.count`` in place and reads ``b.count``, the same tensor: the
    loaded program must see its own increments (tied, not two copies)."""
    shared = torch.zeros(3)
    root = nn.Module()
    root.a, root.b = nn.Module(), nn.Module()
    root.a.register_buffer("count", shared)
    root.b.register_buffer("count", shared)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.call_method("add_", (graph.get_attr("a.count"), 1))
    graph.output(graph.call_function(torch.add, (x, graph.get_attr("b.count"))))
    gm = torch.fx.GraphModule(root, graph)
    loaded = load_program(save_program(gm, tmp_path / "tied", (torch.zeros(3),), format="code")[0])
    fresh = torch.randn(3)
    for calls in (1, 2, 3):
        assert torch.equal(loaded(fresh), fresh + calls)
    assert torch.equal(shared, torch.zeros(3))  # saving and the loaded copy never touch gm's tensor


def test_save_errors_are_typed_and_leave_no_half_written_folder(tmp_path):
    gm = fxopt.optimize(_Net().eval(), example_inputs=(torch.randn(3, 4),))
    with pytest.raises(SaveError, match="unknown format"):
        save_program(gm, tmp_path / "x", (torch.randn(3, 4),), format="onnx")
    exported = torch.export.export(_Net().eval(), (torch.randn(3, 4),)).module()
    with pytest.raises(SaveError):  # torch.export's modules do not pickle
        save_program(exported, tmp_path / "y", (torch.randn(3, 4),), format="code")
    assert not (tmp_path / "y").exists()
