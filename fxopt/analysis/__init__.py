"""Analyses over GraphModules: shapes, structure, aliasing, effects and liveness."""

from fxopt.analysis.manager import AnalysisManager, register_analysis, registered_analyses

__all__ = ["AnalysisManager", "register_analysis", "registered_analyses"]
