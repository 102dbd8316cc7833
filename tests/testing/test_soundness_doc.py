"""Every python block of docs/soundness.md runs as written (each in a fresh namespace)."""

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "soundness.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_page_has_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_example_runs(index):
    exec(compile(BLOCKS[index], f"{DOC.name}[block {index}]", "exec"), {"__name__": "__doc_example__"})
