"""fxopt: composable, verifiable optimization passes over torch.fx GraphModules.

Quick start::

    import fxopt, torch
    gm = fxopt.optimize(torch.fx.symbolic_trace(model), example_inputs=(x,), verify=True)
    print(fxopt.report_of(gm))
"""

from fxopt.analysis.ops import declare_op
from fxopt.compile import compile  # the function, bound over the package of its name
from fxopt.errors import (
    AnalysisError,
    FactoryError,
    FxoptError,
    InputError,
    MissingFakeImplError,
    ModelTypeError,
    NotAPassError,
    PassContractError,
    PassError,
    PassOptionError,
    PipelineError,
    ProfileError,
    SavedFormatError,
    SaveError,
    TraceError,
    UnknownPassError,
    VerificationError,
)
from fxopt.manager import Instrumentation, PassManager, VerifyEach
from fxopt.optimize import DEFAULT_PIPELINE, optimize, report_of
from fxopt.pass_protocol import FunctionPass, Option, Pass, PassResult
from fxopt.pipeline import Conditional, Fixpoint, SequencePass, parse_pipeline
from fxopt.provenance import origins, record_replacement
from fxopt.registry import get_pass_class, register_pass, registered_passes
from fxopt.report import PassRecord, Report

__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("profile", "Profile"):  # torch.profiler: loaded on use
        import fxopt.profiling

        return getattr(fxopt.profiling, name)
    if name == "profile_compiled":
        from fxopt.compile.profile import profile_compiled

        return profile_compiled
    raise AttributeError(f"module 'fxopt' has no attribute {name!r}")


__all__ = [
    "DEFAULT_PIPELINE", "AnalysisError", "Conditional", "FactoryError", "Fixpoint", "FunctionPass",
    "FxoptError", "InputError", "Instrumentation", "MissingFakeImplError", "ModelTypeError",
    "NotAPassError", "Option", "Pass", "PassContractError", "PassError", "PassManager",
    "PassOptionError", "PassRecord", "PassResult", "PipelineError", "Profile", "ProfileError",
    "Report", "SavedFormatError", "SaveError", "SequencePass", "TraceError", "UnknownPassError", "VerificationError",
    "VerifyEach", "compile", "declare_op", "get_pass_class", "optimize", "origins", "parse_pipeline",
    "profile", "profile_compiled", "record_replacement",
    "register_pass", "registered_passes", "report_of",
]
