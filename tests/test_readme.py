"""The README and docs/ run as written.

- Every ```python block of README.md and docs/*.md runs as its own script, in a fresh
  subprocess and an empty temporary directory: it must be self-contained (its imports and
  a model built in the block). A block preceded by ``<!-- norun: reason -->`` is skipped
  with that reason (for what cannot run here, e.g. a GPU); ``<!-- pytest -->`` runs the
  block as a pytest test file instead (blocks that define tests with fixtures).
- Every relative link of those pages points at a file or folder of the repository.
- ``.ci/run`` runs exactly the README's test command.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^[ \t]*```(\w*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*(norun|pytest)\b:?\s*(.*?)\s*-->\s*\Z", re.S)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
TIMEOUT = 300  # seconds per block; the slowest (an Inductor compile) takes well under a minute


def blocks(lang: str) -> list[tuple[str, str, str | None, str]]:
    """(where, code, marker, marker text) of each ```lang block: where is 'page:line'."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            if match.group(1) != lang:
                continue
            line = text.count("\n", 0, match.start()) + 1
            marker = MARKER.search(text[:match.start()].rstrip() + "\n")
            where = f"{page.relative_to(REPO)}:{line}"
            code = textwrap.dedent(match.group(2))  # a block indented in a list item
            found.append((where, code, *(marker.groups() if marker else (None, ""))))
    return found


PYTHON = blocks("python")


def test_there_are_blocks_to_run() -> None:
    assert len(PYTHON) >= 10 and any(w.startswith("README.md") for w, *_ in PYTHON)


@pytest.mark.parametrize(("where", "code", "marker", "reason"), PYTHON, ids=[b[0] for b in PYTHON])
def test_python_block_runs(where: str, code: str, marker: str | None, reason: str,
                           tmp_path: Path) -> None:
    if marker == "norun":
        pytest.skip(f"{where}: {reason}")
    script = tmp_path / ("test_block.py" if marker == "pytest" else "block.py")
    script.write_text(code, encoding="utf-8")
    command = ([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(script)]
               if marker == "pytest" else [sys.executable, str(script)])
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    try:
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True,
                              timeout=TIMEOUT, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the python block at {where} did not finish within {TIMEOUT} s")
    assert done.returncode == 0, (f"the python block at {where} failed "
                                  f"(exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-6000:]}")


def test_markers_are_understood() -> None:
    """A marker with a typo would silently run (or not run) a block: every HTML comment
    right before a python block must be one of ours."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            before = text[:match.start()].rstrip()
            if match.group(1) == "python" and before.endswith("-->"):
                comment = before[before.rindex("<!--"):] + "\n"
                assert MARKER.search(comment), f"{page.name}: unknown marker {comment.strip()!r}"


def test_norun_is_used_sparingly() -> None:
    skipped = [where for where, _, marker, _ in PYTHON if marker == "norun"]
    assert not any(w.startswith("README.md") for w in skipped), skipped
    assert len(skipped) <= max(2, len(PYTHON) // 5), skipped


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))  # links inside code are code
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists() or REPO not in (path, *path.parents):
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)} links to missing files: {broken}"


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    commands = [code.strip() for lang, code in ((m.group(1), m.group(2)) for m in FENCE.finditer(readme))
                if lang == "bash" and "pytest" in code]
    assert len(commands) == 1, "the README should have exactly one test command"
    ci = re.search(r'^TEST_COMMAND="(.*)"$', (REPO / ".ci" / "run").read_text(), re.M)
    assert ci is not None and ci.group(1) == commands[0]
