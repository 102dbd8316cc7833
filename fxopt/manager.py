"""The PassManager: runs passes transactionally, with cached analyses and instrumentation.

Each leaf pass runs inside a transaction: a cheap snapshot of the graph and module
state is taken first, and if the pass raises, breaks the pass contract or fails
verification, the GraphModule is put back exactly as it was (graph, generated code,
attributes, parameters, buffers) before a typed error naming the pass is raised.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from fxopt.analysis.shapes import propagate_meta_values
from fxopt.compile.seeding import seeded
from fxopt.context import PassContext, infer_training
from fxopt.errors import (
    FxoptError,
    InputError,
    MissingFakeImplError,
    ModelTypeError,
    PassContractError,
    PassError,
    VerificationError,
)
from fxopt.numerics import compare
from fxopt.pass_protocol import Pass, PassResult
from fxopt.pipeline import (
    Composite,
    Conditional,
    Fixpoint,
    PassLike,
    check_ordering,
    needs_fake_values,
    resolve,
)
from fxopt.progress import progress
from fxopt.report import PassRecord, Report
from fxopt.snapshot import GraphSnapshot, ModuleState, TensorGuard

REPORT_KEY = "fxopt.report"


class Instrumentation:
    """Hooks called around every leaf pass. Subclass and override what you need.

    ``after_pass`` runs inside the pass's transaction: raising from it rolls the pass
    back (that is how verify-each works).
    """

    def before_pass(self, pass_: Pass, gm: fx.GraphModule, ctx: PassContext) -> None:
        """Called before ``pass_`` runs."""

    def after_pass(self, pass_: Pass, gm: fx.GraphModule, ctx: PassContext, record: PassRecord) -> None:
        """Called after ``pass_`` ran successfully; ``record`` holds its statistics."""


class VerifyEach(Instrumentation):
    """Lint and numerically compare the graph after each changing pass with before it."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any],
                 rtol: float | None = None, atol: float | None = None):
        self.inputs = tuple(example_inputs)
        self.rtol, self.atol = rtol, atol
        self.reference = self._execute(gm)

    def _execute(self, gm: fx.GraphModule) -> Any:
        """Run ``gm`` on clones of the inputs; buffers it writes (training-mode running
        statistics) are put back, since they are the user's."""
        inputs = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, self.inputs)
        # batch norm updates its statistics without bumping their version counters
        buffers = [(b, b.clone()) for b in gm.buffers() if not b.is_inference()]
        with seeded(gm, 0), torch.no_grad():  # the global generator only if gm draws from it
            try:
                return gm(*inputs)
            finally:
                for b, saved in buffers:
                    if not torch.equal(b, saved):
                        b.copy_(saved)

    def after_pass(self, pass_: Pass, gm: fx.GraphModule, ctx: PassContext, record: PassRecord) -> None:
        if not record.changed:
            return
        try:
            gm.graph.lint()
        except Exception as exc:
            raise VerificationError(pass_.name, f"graph lint failed: {exc}") from exc
        try:
            out = self._execute(gm)
        except Exception as exc:
            raise VerificationError(pass_.name, f"the rewritten graph raises {type(exc).__name__}: {exc}") from exc
        mismatch = compare(self.reference, out, self.rtol, self.atol)
        if mismatch is not None:
            raise VerificationError(pass_.name, f"not equivalent to the graph before it: {mismatch}")
        self.reference = out


class PassManager:
    """Runs a pipeline of passes over a GraphModule in place.

    ``passes`` accepts names, textual pipelines, Pass objects or classes, plain
    functions and nested lists; everything is resolved and checked (names, options,
    ordering constraints) in the constructor, before any pass runs.

    A run that lasts more than two seconds shows a progress bar over the passes where
    stderr is a terminal; ``progress=False`` hides it, ``True`` forces it
    (:mod:`fxopt.progress`).

    ``shape_rules=False`` makes every shape propagation a FakeTensor run, so ``meta['val']``
    holds FakeTensors even where fxopt's shape rules would do (:mod:`fxopt.analysis.shapes`).
    """

    def __init__(
        self,
        passes: PassLike | Iterable[PassLike],
        *,
        verify: bool = False,
        instrument: bool = True,
        hooks: Iterable[Instrumentation] = (),
        rtol: float | None = None,
        atol: float | None = None,
        tensor_backup_limit: int = 1 << 30,
        progress: bool | None = None,
        shape_rules: bool = True,
    ):
        self.passes = resolve(passes)
        self.progress = progress
        check_ordering(self.passes)
        self.verify = verify
        self.instrument = instrument
        self.hooks = list(hooks)
        self.rtol, self.atol = rtol, atol
        self.tensor_backup_limit = tensor_backup_limit
        self.shape_rules = shape_rules

    def run(self, gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None, *,
            training: bool | None = None) -> Report:
        """Optimize ``gm`` in place and return the report (also at ``gm.meta['fxopt.report']``)."""
        if not isinstance(gm, fx.GraphModule):
            raise ModelTypeError(f"PassManager.run takes a torch.fx.GraphModule, got {type(gm).__name__}")
        if example_inputs is not None and not isinstance(example_inputs, (tuple, list)):
            raise InputError(f"example_inputs must be a tuple of inputs, got {type(example_inputs).__name__}")
        if self.verify and example_inputs is None:
            raise InputError("verify=True needs example_inputs to run the graph on")
        ctx = PassContext(gm, tuple(example_inputs) if example_inputs is not None else None,
                          training=infer_training(gm) if training is None else training,
                          # hooks of the user's may read values: they get FakeTensors
                          meta_values=self.shape_rules and not self.hooks
                          and not any(map(needs_fake_values, self.passes)))
        if example_inputs is not None:
            check_example_inputs(gm, ctx)
        hooks = list(self.hooks)
        if self.verify:
            hooks.append(VerifyEach(gm, example_inputs, self.rtol, self.atol))
            ctx.report.verified = True
        run = _Run(gm, ctx, hooks if (self.instrument or self.verify) else [], self.instrument,
                   TensorGuard(gm, self.tensor_backup_limit))
        with progress(total=len(self.passes), desc="optimizing", unit="pass", enabled=self.progress,
                      delay=2.0) as bar:
            for p in self.passes:
                bar.set_postfix_str(p.name, refresh=False)  # shown once the delay has passed
                ctx.report.records.append(run.execute(p))
                bar.update()
        gm.meta[REPORT_KEY] = ctx.report
        return ctx.report


class _Run:
    """The state of one PassManager.run: executes (nested) passes transactionally."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext, hooks: list[Instrumentation],
                 keep_snapshots: bool, guard: TensorGuard):
        self.gm, self.ctx, self.hooks = gm, ctx, hooks
        self.keep_snapshots = keep_snapshots
        self.guard = guard

    def execute(self, p: Pass) -> PassRecord:
        if isinstance(p, Composite):
            return self._composite(p)
        return self._leaf(p)

    def _composite(self, p: Composite) -> PassRecord:
        record = PassRecord(p.name, nodes_before=len(self.gm.graph.nodes))
        start = time.perf_counter()
        if isinstance(p, Conditional) and not p.predicate(self.gm, self.ctx):
            record.skipped = "condition is false"
        elif isinstance(p, Fixpoint):
            bound = p.options["max_rounds"]
            rounds, changed = 0, True
            while changed and rounds < bound:
                rounds += 1
                round_records = [self.execute(child) for child in p.children]
                record.children.extend(round_records)
                changed = any(r.changed for r in round_records)
                record.changed |= changed
            record.rounds = rounds
            if changed:
                message = f"fixpoint hit its bound of {bound} rounds and was still changing the graph"
                record.warnings.append(message)
                self.ctx.warn(message)
        else:
            for child in p.children:
                child_record = self.execute(child)
                record.children.append(child_record)
                record.changed |= child_record.changed
        record.seconds = time.perf_counter() - start
        record.nodes_after = len(self.gm.graph.nodes)
        return record

    def _leaf(self, p: Pass) -> PassRecord:
        gm, ctx = self.gm, self.ctx
        record = PassRecord(p.name, nodes_before=len(gm.graph.nodes))
        if p.inference_only and ctx.training:
            record.skipped = "inference-only pass skipped on a training graph"
            record.nodes_after = record.nodes_before
            return record
        snapshot = GraphSnapshot.take(gm.graph)
        state = ModuleState(gm)
        start = time.perf_counter()
        try:
            for hook in self.hooks:
                hook.before_pass(p, gm, ctx)
            for name in p.requires:
                ctx.analysis(name)
            result = _as_result(p, p.run(gm, ctx))
            written = self.guard.changed()
            if written:
                raise PassContractError(
                    p.name, f"wrote into existing tensor {written[0]!r} in place (or swapped its "
                            "data); passes must create new tensors instead, because the tensors "
                            "are shared with the user's model")
            record.changed = result.changed or len(gm.graph.nodes) != len(snapshot)
            record.stats = result.stats
            if record.changed:
                gm.recompile()
                ctx.analyses.invalidate(p.preserves)
            record.seconds = time.perf_counter() - start
            record.nodes_after = len(gm.graph.nodes)
            for hook in self.hooks:
                hook.after_pass(p, gm, ctx, record)
        except BaseException as exc:
            self._rollback(snapshot, state)
            if isinstance(exc, PassError) or not isinstance(exc, Exception):
                raise
            message = str(exc) if isinstance(exc, FxoptError) else f"{type(exc).__name__}: {exc}"
            raise PassError(p.name, message, node=getattr(exc, "node", None)) from exc
        if record.changed:  # tensors the pass added are guarded from now on
            self.guard.track(gm)
        if record.changed and self.keep_snapshots:
            record.before = snapshot
        return record

    def _rollback(self, snapshot: GraphSnapshot, state: ModuleState) -> None:
        written = self.guard.changed()
        if written and not self.guard.restore():
            self.ctx.warn(
                f"data of {', '.join(written)} was written in place and could not be restored "
                "(the tensor backup was skipped: raise tensor_backup_limit)")
        state.restore()
        self.gm.graph = snapshot.build(self.gm)
        self.ctx.analyses.invalidate()


def _as_result(p: Pass, value: Any) -> PassResult:
    if isinstance(value, PassResult):
        return value
    if isinstance(value, bool):
        return PassResult(changed=value)
    raise PassContractError(p.name, f"run() returned {type(value).__name__}; expected PassResult or bool")


def check_example_inputs(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Reject example inputs of the wrong arity, shape or dtype before any pass runs.

    Static checks against placeholder metadata come first (clear messages); then a run of
    fxopt's shape rules (meta tensors, no fake mode) catches shapes that only fail deeper in
    the graph. Where the run accepts meta values that run is the shapes analysis, which
    passes then get for free; where a pass needs FakeTensors it only validates, and the
    FakeTensor run waits for the first pass that asks for shapes. A graph the rules do not
    cover (or inputs they decline) is validated by a FakeTensor run, whose errors name the
    node. On failure the graph's metadata is restored: bad input leaves the user's graph
    untouched.
    """
    inputs = ctx.example_inputs or ()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    try:
        flat = list(gm.graph.process_inputs(*inputs))
    except Exception as exc:
        raise InputError(f"example inputs do not match the graph's input structure: {exc}") from None
    varargs = any(str(p.target).startswith("*") for p in placeholders)
    required = [p for p in placeholders if not p.args and not str(p.target).startswith("*")]
    if len(flat) < len(required) or (len(flat) > len(placeholders) and not varargs):
        names = ", ".join(p.name for p in placeholders)
        raise InputError(f"the graph takes {len(required)} input(s) ({names}), got {len(flat)}")
    for p, value in zip(placeholders, flat):
        expected = p.meta.get("val")
        if isinstance(expected, torch.Tensor) and isinstance(value, torch.Tensor):
            if expected.dtype != value.dtype:
                raise InputError(f"input {p.name!r}: dtype {value.dtype}, the graph expects {expected.dtype}")
            if expected.dim() != value.dim() or any(
                isinstance(e, int) and e != v for e, v in zip(expected.shape, value.shape)
            ):
                raise InputError(f"input {p.name!r}: shape {tuple(value.shape)}, "
                                 f"the graph expects {tuple(expected.shape)}")
    if not ctx.meta_values and propagate_meta_values(gm, ctx.example_inputs, record=False) is not None:
        return  # the inputs fit; shapes wait for a pass that asks (it gets FakeTensors)
    snapshot = GraphSnapshot.take(gm.graph)
    try:
        ctx.analysis("shapes")
    except FxoptError as exc:
        snapshot.restore_meta()
        if isinstance(exc, MissingFakeImplError):  # the op's fault, not the inputs'
            raise
        raise InputError(f"example inputs do not fit the graph: {exc}") from exc
