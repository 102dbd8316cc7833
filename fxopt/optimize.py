"""``fxopt.optimize``: the one-call entry point over models and GraphModules."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.fx as fx
import torch.nn as nn

from fxopt.errors import InputError, ModelTypeError, TraceError
from fxopt.manager import REPORT_KEY, Instrumentation, PassManager
from fxopt.pipeline import PassLike
from fxopt.report import Report

if TYPE_CHECKING:  # the module, not the package: its __init__ imports run, which imports optimize
    from fxopt.profiling.result import Profile

#: measures a graph on inputs: ``fxopt.profile``, or a ``functools.partial`` of it. A
#: parameter, not an import: fxopt.profiling sits above optimize (fxopt.profiling.run captures
#: models with it).
Profiler = Callable[[fx.GraphModule, Sequence[Any]], "Profile"]

#: what ``optimize`` runs when ``passes`` is omitted: inference cleanups, safe on any graph
DEFAULT_PIPELINE: tuple[str, ...] = (
    "remove_dropout",
    "eliminate_identity",
    "fold_conv_bn",
    "fuse_conv_bn_relu",
    "fuse_add_relu",
    "fuse_linear_relu",
    "fuse_linear_gelu",
    "constant_fold",
    "cse",
    "dce",
)


def optimize(
    model: nn.Module | fx.GraphModule | torch.export.ExportedProgram,
    passes: PassLike | Iterable[PassLike] | None = None,
    example_inputs: Sequence[Any] | None = None,
    *,
    verify: bool = False,
    inplace: bool = False,
    training: bool | None = None,
    instrument: bool = True,
    hooks: Iterable[Instrumentation] = (),
    rtol: float | None = None,
    atol: float | None = None,
    profile: Profiler | Literal[False] | None = None,
    progress: bool | None = None,
    shape_rules: bool = True,
) -> fx.GraphModule:
    """Run ``passes`` (default: :data:`DEFAULT_PIPELINE`) over a model; return the result.

    ``model`` may be a GraphModule (``symbolic_trace``, ``torch.export(...).module()``,
    ``make_fx``), an ``ExportedProgram``, or a plain ``nn.Module`` (traced here with
    ``symbolic_trace``). The user's model is never modified unless ``inplace=True``:
    the optimized GraphModule is a copy that shares parameter tensors with it (passes
    create new tensors rather than writing into shared ones).

    ``training`` (default: inferred, see :func:`fxopt.context.infer_training`) makes
    inference-only passes (folding, fusion, quantization) skip with a line in the report.

    The run's report is ``fxopt.report_of(result)`` (also ``result.meta['fxopt.report']``).
    With ``verify=True`` every pass is checked for graph lint and numerical equivalence
    on ``example_inputs``; the first pass that breaks it is named in the error and rolled
    back. A run longer than two seconds shows a progress bar on a terminal's stderr
    (``progress=False`` hides it).

    Shapes (``meta['val']``) come from fxopt's own shape rules where every pass and every op
    of the graph allows it: meta-device tensors with torch's shapes, strides and dtypes,
    found without importing ``torch._dynamo`` (about a second of CPU on the first call of a
    process); elsewhere from FakeTensor propagation. ``shape_rules=False`` always uses
    FakeTensors (docs/passes.md, "Shapes").

    ``profile=fxopt.profile`` measures the graph on ``example_inputs`` before and after the
    passes with that profiler (``functools.partial(fxopt.profile, repeat=20)`` for more
    runs) and puts the :class:`~fxopt.profiling.ProfileDiff`, which credits the change in
    time and memory to the passes, in ``report_of(result).profile``. ``profile=None`` or
    ``False`` measures nothing.
    """
    if profile is False:
        profile = None
    if profile is not None and not callable(profile):
        raise InputError(f"profile takes the profiler to measure with (profile=fxopt.profile), not {profile!r}")
    if profile is not None and example_inputs is None:
        raise InputError("profile needs example_inputs to run the graph on")
    gm = as_graph_module(model)
    if not inplace and not _owned_capture(model, gm):
        gm = copy_sharing_tensors(gm)
    manager = PassManager(
        DEFAULT_PIPELINE if passes is None else passes,
        verify=verify, instrument=instrument, hooks=hooks, rtol=rtol, atol=atol, progress=progress,
        shape_rules=shape_rules,
    )
    original = copy_sharing_tensors(gm) if profile is not None else None
    report = manager.run(gm, example_inputs, training=training)
    if original is not None:
        report.profile = profile(original, example_inputs).diff(profile(gm, example_inputs), report)
    return gm


def report_of(gm: fx.GraphModule) -> Report:
    """The report of the last fxopt run over ``gm``."""
    try:
        return gm.meta[REPORT_KEY]
    except (AttributeError, KeyError):
        raise KeyError("this GraphModule has not been through fxopt.optimize / PassManager.run") from None


def as_graph_module(model: Any) -> fx.GraphModule:
    """Capture ``model`` as a GraphModule, or explain why it cannot be and what to do."""
    if isinstance(model, fx.GraphModule):
        return model
    if isinstance(model, torch.export.ExportedProgram):
        return model.module()
    if not isinstance(model, nn.Module):
        raise ModelTypeError(f"optimize takes an nn.Module, GraphModule or ExportedProgram, got {type(model).__name__}")
    try:
        return fx.symbolic_trace(model)
    except Exception as exc:
        raise TraceError(
            f"torch.fx.symbolic_trace could not trace {type(model).__name__}: {type(exc).__name__}: {exc}\n"
            "Data-dependent control flow and non-torch calls need another capture path: pass "
            "torch.export.export(model, example_inputs).module() (or the ExportedProgram itself), "
            "a graph from torch.fx.experimental.proxy_tensor.make_fx, or use "
            "fxopt's torch.compile backend, which handles graph breaks."
        ) from exc


def _owned_capture(model: Any, gm: fx.GraphModule) -> bool:
    """Whether ``gm`` is a capture nobody else holds, so optimizing it in place changes
    nothing of the user's: ``ep.module()`` builds a new graph and new modules over the
    program's tensors (which the manager's guard protects), unless it holds nested
    GraphModules (subgraphs of control flow), which it shares with the program."""
    return isinstance(model, torch.export.ExportedProgram) and not any(
        isinstance(m, fx.GraphModule) for m in gm.modules() if m is not gm)


def copy_sharing_tensors(gm: fx.GraphModule) -> fx.GraphModule:
    """A deep copy of ``gm``'s graph and module tree whose tensors are the originals.

    Copying the structure is what keeps the user's model untouched; sharing the tensors
    keeps a multi-GB model from being duplicated in memory. Submodules of torch.nn's own
    classes are copied shallowly (:func:`_structural_copy`), which is all a pass can change
    of them; ``copy.deepcopy`` of such a tree costs a large share of a cheap run on an
    LLM-sized graph. Other modules (the user's classes) are deep-copied as before.
    """
    memo: dict[int, Any] = {}
    for module in gm.modules():
        for value in (*module._parameters.values(), *module._buffers.values(), *vars(module).values()):
            if isinstance(value, torch.Tensor):
                memo[id(value)] = value
    for module in _post_order(gm):
        if module is not gm and id(module) not in memo and _torch_module(module):
            memo[id(module)] = _structural_copy(module, memo)
    return copy.deepcopy(gm, memo)


def _torch_module(module: nn.Module) -> bool:
    """A module of torch.nn's own classes (not a GraphModule, which holds a graph)."""
    return type(module).__module__.startswith("torch.nn.modules.")


def _post_order(root: nn.Module) -> list[nn.Module]:
    """Every module under ``root`` once, children before their parents."""
    out: list[nn.Module] = []
    seen: set[int] = set()
    stack: list[tuple[nn.Module, bool]] = [(root, False)]
    while stack:
        module, expanded = stack.pop()
        if expanded:
            out.append(module)
            continue
        if id(module) in seen:
            continue
        seen.add(id(module))
        stack.append((module, True))
        stack.extend((child, False) for child in module._modules.values() if child is not None)
    return out


def _structural_copy(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """A new module object of the same class whose containers (parameter, buffer, child and
    hook dicts, lists such as an RNN's flat weights) are new, holding the same tensors and
    the copies of the children (already in ``memo``): what a deep copy gives a torch.nn
    module, whose other attributes are immutable (numbers, strings, tuples)."""
    cls = type(module)
    new = cls.__new__(cls)  # what copy.copy does, without its generic (slow) protocol
    state = {k: v.copy() if type(v) in _CONTAINERS else v for k, v in module.__dict__.items()}
    state["_modules"] = {k: None if c is None else memo.get(id(c), c) for k, c in module._modules.items()}
    new.__dict__.update(state)
    return new


_CONTAINERS = (dict, list, set, OrderedDict)
