"""``fxopt profile MODULE:FACTORY``: table, trace, CSV and report files."""

import json
import re

from fxopt.cli import main


def test_profile_command_writes_trace_csv_and_report(tmp_path, capsys):
    factory = tmp_path / "models.py"
    factory.write_text(
        "import torch\n"
        "def make():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))\n")
    trace, report, rows = tmp_path / "t.json", tmp_path / "r.html", tmp_path / "rows.csv"
    code = main(["profile", f"{factory}:make", "--input-shape", "8,32", "--top", "2", "--repeat", "1",
                 "--trace", str(trace), "--report", str(report), "--csv", str(rows)])
    assert code == 0
    out = capsys.readouterr().out
    ranked = [line.split()[1] for line in out.splitlines() if re.match(r"^\d+\s+\S+\s", line)]
    assert len(ranked) == 2  # --top 2
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"fxopt::_0", "fxopt::_1", "fxopt::_2"} <= names
    assert 'class="fx-memory-curve"' in report.read_text()
    assert rows.read_text().splitlines()[0].startswith("node,")


def test_profile_command_without_input_shape(tmp_path, capsys):
    """The issue's form, ``fxopt profile module:factory``: inputs from the factory's pair,
    or guessed from the first layer."""
    factory = tmp_path / "zoo.py"
    factory.write_text(
        "import torch\n"
        "def cnn():\n"
        "    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, stride=8), torch.nn.ReLU(), torch.nn.Flatten())\n"
        "def pair():\n"
        "    return torch.nn.Linear(5, 2), torch.randn(3, 5)\n")
    assert main(["profile", f"{factory}:cnn", "--repeat", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "float32[1,3,224,224]" in out and "conv" in out
    assert main(["profile", f"{factory}:pair", "--repeat", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "guessed" not in out and "matmul" in out
