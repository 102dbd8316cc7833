"""Typed exceptions: every error fxopt raises names the pass, node or argument at fault.

All of them derive from :class:`FxoptError`, so ``except fxopt.FxoptError`` catches
anything fxopt raises on purpose, while each subclass also derives from the builtin that
fits (``ValueError``, ``TypeError``) so generic handlers keep working.
"""

from __future__ import annotations

from collections.abc import Iterable


class FxoptError(Exception):
    """Base class of every error fxopt raises deliberately."""


class PipelineError(FxoptError, ValueError):
    """A pipeline is malformed: bad syntax, unknown pass, bad option, broken ordering."""


class UnknownPassError(PipelineError, KeyError):
    """A pass name is not registered; the message lists the closest registered names."""

    def __init__(self, name: str, suggestions: Iterable[str]):
        self.name = name
        self.suggestions = list(suggestions)
        hint = f"; did you mean {', '.join(map(repr, self.suggestions))}?" if self.suggestions else ""
        super().__init__(f"unknown pass {name!r}{hint} (`fxopt passes` lists them all)")

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0])


class NotAPassError(PipelineError, TypeError):
    """Something given as a pass (or pipeline) is none of the things a pass can be."""


class PassOptionError(PipelineError, TypeError):
    """An option given to a pass does not exist or has the wrong type."""

    def __init__(self, pass_name: str, option: str, message: str):
        self.pass_name = pass_name
        self.option = option
        super().__init__(f"pass {pass_name!r}, option {option!r}: {message}")


class ModelTypeError(FxoptError, TypeError):
    """What was given as the model or graph is none of the things fxopt works on."""


class InputError(FxoptError, ValueError):
    """Example inputs do not fit the graph (arity, shape or dtype); raised before any pass."""


class TraceError(FxoptError, RuntimeError):
    """An ``nn.Module`` could not be captured as a GraphModule."""


class AnalysisError(FxoptError, RuntimeError):
    """An analysis could not be computed (e.g. shapes without example inputs)."""

    def __init__(self, analysis: str, message: str, node: str | None = None):
        self.analysis = analysis
        self.node = node
        where = f" at node {node!r}" if node else ""
        super().__init__(f"analysis {analysis!r}{where}: {message}")


class MissingFakeImplError(AnalysisError):
    """An op has no fake (meta) implementation, so shapes cannot be propagated through it.

    Not a problem with the example inputs: the op's author registers one with
    ``torch.library.register_fake`` (``@my_op.register_fake`` for ``custom_op``).
    """

    def __init__(self, op: str, node: str, detail: str):
        self.op = op
        super().__init__(
            "shapes", f"op {op} has no fake implementation, so fxopt cannot propagate shapes "
                      f"through it; register one with torch.library.register_fake({op!r}) "
                      f"(torch says: {detail})", node=node)


class PassError(FxoptError, RuntimeError):
    """A pass raised; the GraphModule was restored to its state before that pass."""

    def __init__(self, pass_name: str, message: str, node: str | None = None):
        self.pass_name = pass_name
        self.node = node
        where = f" at node {node!r}" if node else ""
        super().__init__(f"pass {pass_name!r} failed{where}: {message}")


class PassContractError(PassError, TypeError):
    """A pass broke the pass contract (wrong return type, mutated a parameter in place)."""


class VerificationError(PassError):
    """A pass produced a graph that fails lint or is not numerically equivalent."""


class EquivalenceError(FxoptError, AssertionError):
    """Two graphs compute different functions (``fxopt.testing.assert_equivalent``).

    ``mismatch`` says where the outputs differ (``out[1]['logits']: ...``) and
    ``diverging_node`` names the first node of the rewritten graph whose value differs
    from its counterpart in the original, when that could be found.
    """

    def __init__(self, message: str, mismatch: object = None, diverging_node: str | None = None):
        self.mismatch = mismatch
        self.diverging_node = diverging_node
        super().__init__(message)


class StructureMismatchError(EquivalenceError):
    """The outputs differ in structure (types, lengths, dict keys, shapes or dtypes)."""


class ReferenceFailureError(FxoptError, RuntimeError):
    """The reference (the graph *before* the rewrite) could not be run or is unusable;
    distinct from :class:`EquivalenceError`, because nothing was compared."""


class NondeterministicReferenceError(ReferenceFailureError):
    """The reference gave different results on two runs with the same inputs and seed."""


class RenderError(FxoptError, RuntimeError):
    """Graphviz could not render a graph; the DOT text is kept so nothing is lost."""

    def __init__(self, message: str, dot_path: str | None = None):
        self.dot_path = dot_path
        kept = f" (the DOT text was written to {dot_path})" if dot_path else ""
        super().__init__(message + kept)


class RendererNotFoundError(RenderError):
    """No graphviz renderer is installed; the message says how to get one."""


class PatternError(FxoptError, ValueError):
    """A pattern or replacement is unusable: untraceable, unused arguments or dead code,
    or a replacement whose signature does not fit the pattern. Raised when the rule is
    created, never while matching."""


class RuleError(FxoptError, RuntimeError):
    """A rule's own code failed while it was applied: a constraint, a ``where`` predicate
    or a per-match callback raised. Names the rule and what raised; the graph is left as
    it was before the rewrite that was being checked."""

    def __init__(self, rule: str, message: str):
        self.rule = rule
        super().__init__(f"rule {rule!r}: {message}")


class ProfileError(FxoptError, RuntimeError):
    """A graph could not be profiled: it raised at ``node`` on the given inputs.
    The module's parameters, buffers and the inputs are left as they were."""

    def __init__(self, message: str, node: str | None = None):
        self.node = node
        where = f" at node {node!r}" if node else ""
        super().__init__(f"profiling failed{where}: {message}")


class FactoryError(FxoptError, ValueError):
    """A ``MODULE:FACTORY`` spec (the command line's model) cannot give a model: the module
    or file is missing or fails to import, the attribute is missing or not callable, the
    factory raised, or it returned something that is not a model."""


class SaveError(FxoptError, RuntimeError):
    """An optimized program could not be written in the format asked for."""


class SavedFormatError(FxoptError, ValueError):
    """A saved program, or the quantized weights in it, is in a format version this fxopt
    cannot read or convert; the message names both versions and what to do."""
