"""The context a pass runs in: example inputs, cached analyses and the report."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from fxopt.analysis.manager import AnalysisManager
from fxopt.report import Report


@dataclass
class PassContext:
    """Shared by every pass of one run.

    ``training`` says whether the graph is meant to be trained; inference-only passes
    are skipped (with a line in the report) when it is true.
    """

    gm: fx.GraphModule
    example_inputs: tuple[Any, ...] | None = None
    training: bool = False
    report: Report = field(default_factory=Report)
    analyses: AnalysisManager = field(init=False)
    #: the fake mode (and fake parameters) every shape propagation of this run shares, set
    #: by the first one (:class:`fxopt.analysis.shapes.FakeState`): each parameter becomes
    #: a fake tensor once per run, not once per propagation
    fake_state: Any = field(default=None, init=False, repr=False)
    #: whether every pass of the run accepts meta values as ``meta['val']`` (none needs
    #: FakeTensors): shape propagation may then use fxopt's own shape rules
    meta_values: bool = False
    #: the last propagation by shape rules (:class:`fxopt.analysis.shapes.MetaRecord`): the
    #: next one evaluates only what the passes since touched and what lies downstream
    meta_record: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.analyses = AnalysisManager(self.gm, self)

    def analysis(self, name: str) -> Any:
        """The (cached) result of the analysis called ``name``."""
        return self.analyses.get(name)

    def warn(self, message: str) -> None:
        """Record a warning in the report and emit it as a Python warning."""
        self.report.warnings.append(message)
        warnings.warn(message, stacklevel=3)


def infer_training(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` is meant to be trained, when the caller does not say.

    For torch-level graphs (symbolic_trace) the module's ``training`` flag is the user's
    statement. ATen-level graphs (torch.export, make_fx) leave their GraphModule's flag at
    its default and encode the mode in their ops instead: such a graph is a training graph
    when some op runs in training mode (a schema argument ``training``/``train`` that is
    true: batch norm updating its statistics, dropout that drops), in the graph or in a
    nested subgraph (``with torch.no_grad()`` blocks become ``wrap_with_set_grad_enabled``
    calls of a subgraph; they say nothing about the mode). Pass ``training=True``
    explicitly to protect an ATen graph without such ops that will be trained.
    """
    if any(_is_torch_level(gm, n) for n in gm.graph.nodes):
        return gm.training
    return _has_training_mode_op(gm)


def _is_torch_level(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_method":
        return True
    if node.op == "call_function":
        return not isinstance(node.target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)) and getattr(
            node.target, "__module__", None) != "_operator"
    if node.op == "call_module":  # export's `_guards_fn` and nested GraphModules do not count
        return type(gm.get_submodule(node.target)).__module__.startswith("torch.nn.modules")
    return False


def _has_training_mode_op(gm: fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            for i, arg in enumerate(node.target._schema.arguments):
                if arg.name in ("training", "train"):
                    value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
                    if value is True:
                        return True
    return any(_has_training_mode_op(sub) for sub in gm.children() if isinstance(sub, fx.GraphModule))
