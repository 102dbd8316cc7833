"""ATen-level fxopt pipelines inside Inductor, and how a failing pass falls back.

The backend's ``post_grad_pre_passes`` and friends run as Inductor custom passes
(:class:`InductorPass`, a ``CustomGraphPass`` with a stable ``uuid()``), so the FX graph
cache and the AOTAutograd cache keep working. A pass that fails there puts Inductor's graph
back as it was and warns (:func:`warn_fallback`), unless the backend runs strict.
"""

from __future__ import annotations

import hashlib
import inspect
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch.fx as fx

from fxopt.errors import FxoptError, PassError
from fxopt.manager import PassManager
from fxopt.pass_protocol import FunctionPass, Pass
from fxopt.pipeline import Composite, Conditional, PassLike
from fxopt.report import Report
from fxopt.snapshot import GraphSnapshot

try:  # torch >= 2.6; the import path has been stable since
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover - older torch has no cache-safe custom passes
    CustomGraphPass = object  # type: ignore[assignment,misc]

__all__ = ["InductorPass", "warn_fallback"]


class InductorPass(CustomGraphPass):
    """An fxopt pipeline as an Inductor custom graph pass, with a stable ``uuid()``.

    The uuid hashes what decides the pass's behaviour: the pipeline (names, options,
    nesting), the source files of every pass and predicate in it, fxopt's own core
    sources, the training flag and strictness. Equal pipelines give equal uuids across
    processes, so Inductor's FX graph cache and the AOTAutograd cache hit; a pipeline whose
    code cannot be found (a lambda typed at a prompt) gets ``None``, which makes Inductor
    skip its caches rather than reuse a stale entry.
    """

    def __init__(self, passes: PassLike | Iterable[PassLike], *, hook: str = "post_grad_custom_pre_pass",
                 training: bool = False, strict: bool = False,
                 reports: list[tuple[str, Report]] | None = None):
        self.manager = PassManager(passes)
        self.hook, self.training, self.strict = hook, training, strict
        self.reports = reports
        self._uuid = _pipeline_uuid(self.manager.passes, (hook, training, strict))

    def uuid(self) -> str | None:
        return self._uuid

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        snapshot = GraphSnapshot.take(graph)
        try:
            report = self.manager.run(gm, training=self.training)
        except FxoptError as exc:
            if self.strict:
                raise
            _restore_in_place(graph, snapshot)
            gm.graph = graph
            gm.recompile()
            culprit = f"pass {exc.pass_name!r}" if isinstance(exc, PassError) else "fxopt"
            warn_fallback(f"({self.hook})", f"{culprit} failed inside Inductor's {self.hook}: {exc}")
            return
        if self.reports is not None:
            self.reports.append((self.hook, report))


def warn_fallback(graph_name: str, reason: str) -> None:
    warnings.warn(f"fxopt backend: {reason}; graph {graph_name} is compiled by plain Inductor "
                  "(pass strict=True to raise instead)", RuntimeWarning, stacklevel=2)


def _restore_in_place(graph: fx.Graph, snapshot: GraphSnapshot) -> None:
    """Put ``graph`` (the very object Inductor holds on to) back to ``snapshot``."""
    rebuilt = snapshot.build()
    placeholders = {n.name: n for n in graph.find_nodes(op="placeholder")}
    if [n.name for n in rebuilt.find_nodes(op="placeholder")] != list(placeholders):
        raise RuntimeError("an ATen-level pass changed the graph's inputs; it cannot be restored in place")
    for node in reversed(list(graph.nodes)):
        if node.op != "placeholder":
            graph.erase_node(node)
    env: dict[fx.Node, fx.Node] = {}
    for node in rebuilt.nodes:
        env[node] = placeholders[node.name] if node.op == "placeholder" else graph.node_copy(node, env.__getitem__)


def _pipeline_uuid(passes: Sequence[Pass], extra: Any) -> str | None:
    hasher = hashlib.sha256(repr((list(map(repr, passes)), extra)).encode())
    hasher.update(_core_source_hash())
    files: set[str] = set()
    for obj in _code_objects(passes):
        try:
            source = inspect.getsourcefile(obj)
        except TypeError:
            source = None
        if source is None or not Path(source).is_file():
            return None
        files.add(source)
        hasher.update(getattr(obj, "__qualname__", repr(obj)).encode())
    for path in sorted(files):
        hasher.update(Path(path).read_bytes())
    return hasher.hexdigest()


def _code_objects(passes: Iterable[Pass]) -> Iterable[Any]:
    for p in passes:
        if isinstance(p, FunctionPass):
            yield p.fn
        else:
            yield type(p)
        if isinstance(p, Conditional):
            yield p.predicate
        if isinstance(p, Composite):
            yield from _code_objects(p.children)


_CORE_HASH: bytes | None = None


def _core_source_hash() -> bytes:
    """A hash of fxopt's own sources: the manager and analyses shape what passes do."""
    global _CORE_HASH
    if _CORE_HASH is None:
        hasher = hashlib.sha256()
        root = Path(__file__).parents[1]
        for path in sorted([*root.glob("*.py"), *root.glob("analysis/*.py"), *root.glob("compile/*.py")]):
            hasher.update(path.read_bytes())
        _CORE_HASH = hasher.digest()
    return _CORE_HASH

