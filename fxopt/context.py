"""The context a pass runs in: example inputs, cached analyses and the report."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

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
    #: free-form settings a caller hands to its passes (e.g. the torch.compile backend)
    settings: dict[str, Any] = field(default_factory=dict)
    analyses: AnalysisManager = field(init=False)

    def __post_init__(self) -> None:
        self.analyses = AnalysisManager(self.gm, self)

    def analysis(self, name: str) -> Any:
        """The (cached) result of the analysis called ``name``."""
        return self.analyses.get(name)

    def warn(self, message: str) -> None:
        """Record a warning in the report and emit it as a Python warning."""
        self.report.warnings.append(message)
        warnings.warn(message, stacklevel=3)
