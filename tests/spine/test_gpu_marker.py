"""The GPU lane (docs/testing.md) is ``pytest -m gpu``: it runs every test that needs CUDA
only if each one carries the ``gpu`` marker, which tests/conftest.py turns into a skip where
no CUDA device is present. A test that skips on ``torch.cuda.is_available()`` by itself
would be left out of the lane, so none may."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _without_cuda(test: ast.expr) -> bool:
    """Whether a condition holds where CUDA is absent: it contains ``not
    <...>.cuda.is_available()``."""
    return any(isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)
               and "cuda.is_available" in ast.unparse(node.operand)
               for node in ast.walk(test))


def _skips(node: ast.AST, name: str) -> bool:
    return any(isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
               and call.func.attr == name for call in ast.walk(node))


def cuda_skips(source: str) -> list[int]:
    """Lines of ``source`` that skip a test where CUDA is absent, other than by the marker:
    ``skipif(not ...cuda.is_available(), ...)`` or ``if not ...cuda.is_available():
    pytest.skip(...)``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "skipif" and node.args and _without_cuda(node.args[0]):
            lines.append(node.lineno)
        if isinstance(node, ast.If) and _without_cuda(node.test) \
                and any(_skips(stmt, "skip") for stmt in node.body):
            lines.append(node.lineno)
    return lines


def test_no_test_skips_on_cuda_by_itself():
    found = {str(path.relative_to(TESTS)): lines for path in sorted(TESTS.rglob("*.py"))
             if path.name != "conftest.py" and (lines := cuda_skips(path.read_text()))}
    assert not found, f"mark these tests @pytest.mark.gpu instead (tests/conftest.py skips them): {found}"


def test_the_check_finds_both_spellings():
    assert cuda_skips('cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="x")\n') == [1]
    assert cuda_skips("import torch\nif not torch.cuda.is_available():\n"
                      "    pytest.skip('x', allow_module_level=True)\n") == [2]
    # skipping where CUDA *is* present (the Triton-interpreter tests) is no GPU test
    assert cuda_skips("if torch.cuda.is_available():\n    pytest.skip('x')\n") == []
