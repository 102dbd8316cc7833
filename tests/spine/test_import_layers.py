"""The package's modules form layers: no import loop, and each module imports on its own.

A loop works only in the order the modules happen to be imported in, and breaks on
another (an ImportError about a partly initialised module, or a name missing from it).
The graph is read from the source with ``ast``, so every loop shows, not only the ones an
import order trips over: imports at module level, inside functions (a lazy import only
defers the loop) and under ``if TYPE_CHECKING:`` (a loop for the type checker, and the
sign of two modules that each need the other) all count. A lower module that must name a
higher one's type declares the part it reads as a ``Protocol`` instead
(``fxopt.profiling.diff.Profiled``, ``fxopt.patterns.matcher.RuleChecks``).
``patterns/`` installs as ``fxopt.patterns``, ``visualize/`` as ``fxopt.visualize``.

The layers that matter most: the compile path (``fxopt.compile``) sits on top of the core
and of profiling; profiling takes compiled callables and never reaches the backend (it used
to import it, which closed a loop ``backend -> optimize -> profiling -> backend``).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parents[2]
#: source folder -> the package it installs as (pyproject's package-dir)
PACKAGES = {"fxopt": "fxopt", "patterns": "fxopt.patterns", "visualize": "fxopt.visualize"}

#: Loops other branches are removing, allowed until they merge (the lead empties this at
#: merge). Each is a strongly connected set of modules. The test fails on any other loop,
#: and on a listed one that no longer exists, so the list cannot outlive its loops.
KNOWN_LOOPS: set[frozenset[str]] = set()


def source_modules() -> dict[str, Path]:
    """Every module of the package, by the name it is imported as."""
    modules = {}
    for folder, package in PACKAGES.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def imported_names(name: str, path: Path | None = None, source: str | None = None) -> list[str]:
    """The dotted names ``name``'s source imports (``from a import b`` gives ``a.b``, which
    is the module ``a.b`` if there is one, else a name in ``a``): every import statement
    anywhere in it, in functions and ``if TYPE_CHECKING:`` blocks too."""
    is_package = path is not None and path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    if source is None:
        source = path.read_text(encoding="utf-8")
    found: list[str] = []
    for node in ast.walk(ast.parse(source, str(path or name))):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.extend(f"{base}.{alias.name}" for alias in node.names)
    return found


def import_graph() -> nx.DiGraph:
    """Module -> the package modules it imports (the longest known prefix of each name)."""
    modules = source_modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for target in imported_names(name, path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph.add_edge(name, target)
    return graph


def loops(graph: nx.DiGraph) -> set[frozenset[str]]:
    """The sets of modules that import each other, directly or around a loop."""
    return {frozenset(c) for c in nx.strongly_connected_components(graph) if len(c) > 1}


def describe(graph: nx.DiGraph, loop: frozenset[str]) -> str:
    cycles = sorted(nx.simple_cycles(graph.subgraph(loop)), key=lambda c: (len(c), c))
    return "\n".join(" -> ".join([*c, c[0]]) for c in cycles)


def test_the_graph_sees_imports_at_every_level():
    graph = import_graph()
    assert len(graph) > 80
    assert graph.has_edge("fxopt.optimize", "fxopt.manager")  # module level
    assert graph.has_edge("fxopt.profiling.run", "fxopt.optimize")  # inside a function
    assert graph.has_edge("fxopt.visualize.report", "fxopt.visualize.figures")  # relative
    assert graph.has_edge("fxopt.patterns.stock", "fxopt.patterns.rules")  # patterns/ installed
    assert graph.has_edge("fxopt.optimize", "fxopt.profiling.result")  # under TYPE_CHECKING only
    assert graph.has_edge("fxopt.compile", "fxopt.compile.backend")  # a package's own function
    assert loops(nx.DiGraph([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")])) == {frozenset("abc")}


def test_imports_in_functions_and_type_checking_blocks_are_edges():
    source = """
import typing
from typing import TYPE_CHECKING
import fxopt.a
if TYPE_CHECKING:
    from fxopt.b import B
if typing.TYPE_CHECKING:
    import fxopt.c
else:
    import fxopt.d
def f():
    from . import e
    class K:
        def g(self):
            from ..x import y
"""
    names = imported_names("fxopt.pkg.mod", source=source)
    assert set(names) == {"typing", "typing.TYPE_CHECKING", "fxopt.a", "fxopt.b.B", "fxopt.c",
                          "fxopt.d", "fxopt.pkg.e", "fxopt.x.y"}


def test_the_type_only_loops_stay_one_way():
    """``profiling.diff`` named ``Profile`` and ``patterns.matcher`` named ``Rule`` under
    TYPE_CHECKING, each back to the module that imports it: both now read a Protocol."""
    graph = import_graph()
    assert graph.has_edge("fxopt.profiling.result", "fxopt.profiling.diff")  # Profile.diff calls it
    assert not nx.has_path(graph, "fxopt.profiling.diff", "fxopt.profiling.result")
    assert graph.has_edge("fxopt.patterns.rules", "fxopt.patterns.matcher")
    assert not nx.has_path(graph, "fxopt.patterns.matcher", "fxopt.patterns.rules")


#: the modules that make up the backend: what only the compile path may reach
BACKEND = ("fxopt.compile.backend", "fxopt.compile.options", "fxopt.compile.inductor_pass",
           "fxopt.compile.freezing")


def test_profiling_never_reaches_the_backend():
    """Profiling measures the callable the compile path hands it. The package keeps its old
    name ``fxopt.profiling.profile_compiled`` as a lazy re-export of the compile path's (its
    ``__init__`` may reach up); none of its modules does."""
    graph = import_graph()
    assert graph.has_edge("fxopt.compile.profile", "fxopt.profiling.inductor")  # the way it goes
    modules = [m for m in graph if m.startswith("fxopt.profiling.")]
    assert "fxopt.profiling.inductor" in modules
    reach = {m: sorted(b for b in BACKEND if nx.has_path(graph, m, b)) for m in modules}
    assert {m: found for m, found in reach.items() if found} == {}


def test_every_package_is_installed():
    """pyproject lists packages explicitly (find_packages cannot map patterns/ and
    visualize/ into the namespace): a folder missing from the list is left out of wheels."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in source_modules().items() if path.name == "__init__.py"}
    assert packages == listed


def test_no_import_loops_but_the_known_ones():
    graph = import_graph()
    found = loops(graph)
    for loop in sorted(found, key=sorted):  # every loop, in the output of a failing run
        print(("known loop" if loop in KNOWN_LOOPS else "LOOP") + ":\n" + describe(graph, loop))
    new = [describe(graph, loop) for loop in found - KNOWN_LOOPS]
    assert not new, "import loops:\n" + "\n\n".join(new)
    gone = [sorted(loop) for loop in KNOWN_LOOPS - found]
    assert not gone, f"KNOWN_LOOPS lists loops that no longer exist, remove them: {gone}"


#: imports each module named on stdin alone, in a fork of an interpreter that has loaded
#: only third-party libraries (torch and Inductor: seconds each): a fresh fxopt every time.
#: A module that needs a missing optional dependency (triton, GPU only) is reported apart.
_IMPORT_EACH = """
import importlib, os, sys, traceback
import torch, torch.fx, torch._inductor.compile_fx, hypothesis, networkx, tabulate
OPTIONAL = {"triton"}
failed, unavailable = [], []
for name in sys.stdin.read().split():
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name in OPTIONAL:
                os._exit(2)
            traceback.print_exc()
            os._exit(1)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if status:
        (unavailable if status == 2 else failed).append(name)
print(" ".join(failed))
print(" ".join(unavailable))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_each_module_imports_on_its_own():
    names = sorted(n for n in source_modules() if not n.endswith(".__main__"))  # __main__ runs the CLI
    result = subprocess.run([sys.executable, "-c", _IMPORT_EACH], input=" ".join(names), capture_output=True,
                            text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    *_, failed, unavailable = (line.split() for line in result.stdout.splitlines())  # after any module's output
    assert failed == [], f"{failed} failed to import alone:\n{result.stderr[-4000:]}"
    # the triton kernels' modules, where triton is not installed (CI)
    assert not unavailable or importlib.util.find_spec("triton") is None, unavailable
