"""The baselines fxopt is compared with: every Inductor mode a user could pick, each checked.

``INDUCTOR_MODES``: default, freezing, ``mode="reduce-overhead"`` and reduce-overhead with
freezing. fxopt's ratio is against the fastest of them, per workload, never against a mode
picked after the fact.

A freezing baseline is checked really frozen. Inductor's freezing needs the *global*
``torch._inductor.config.freezing`` while Dynamo traces (``torch._dynamo.utils.is_parameter_freezing``):
only then are the parameters graph constants instead of inputs; ``options={"freezing": True}``
alone patches Inductor, which then has no parameter to freeze. So each graph records what
Dynamo handed over, and a freezing variant that was not frozen is reported as a broken
harness (session 6's zoo once timed unfrozen code under a "freezing" column).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

#: the Inductor modes fxopt is compared with: the best of them, per workload
INDUCTOR_MODES = ("inductor", "inductor_freezing", "reduce_overhead", "reduce_overhead_freezing")
#: variants whose ``frozen`` must be true: a false one means the harness did not measure them
MUST_FREEZE = ("inductor_freezing", "reduce_overhead_freezing", "fxopt")
#: variants that capture CUDA graphs themselves: a harness's own capture of them is not timed
SELF_GRAPHED = ("reduce_overhead", "reduce_overhead_freezing")

_MODES: dict[str, tuple[str | None, bool]] = {  # variant: (torch.compile mode, freezing)
    "inductor": (None, False), "inductor_freezing": (None, True),
    "reduce_overhead": ("reduce-overhead", False), "reduce_overhead_freezing": ("reduce-overhead", True),
}


class ObservedInductor(torch._TorchCompileInductorWrapper):
    """Inductor as ``torch.compile(mode=..., options=...)`` builds it, noting per graph
    whether it was really frozen: parameters among the inputs Dynamo handed over, the global
    flag at that moment and the freezing option.

    Equality is identity: ``torch.compile``'s wrappers compare equal when their options do,
    and Dynamo then served one variant another's cache entry (session 6: reduce-overhead +
    freezing ran reduce-overhead's unfrozen code).
    """

    def __init__(self, mode: str | None, options: dict[str, Any] | None, dynamic: bool | None,
                 graphs: list[dict[str, Any]]):
        super().__init__(mode, options, dynamic)
        self.graphs = graphs

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __call__(self, model_: torch.fx.GraphModule, inputs_: list[Any], **kwargs: Any) -> Any:
        freezing_option = self.config.get("freezing", torch._inductor.config.freezing)
        param_inputs = sum(isinstance(x, nn.Parameter) for x in inputs_)
        traced_frozen = torch._inductor.config.freezing and not torch.is_grad_enabled()
        self.graphs.append({
            "param_inputs": param_inputs,
            "constant_tensors": sum(n.op == "get_attr" for n in model_.graph.nodes),
            "freezing_flag_at_trace": traced_frozen,
            "freezing_option": freezing_option,
            "frozen": bool(freezing_option and traced_frozen and param_inputs == 0),
        })
        return super().__call__(model_, inputs_, **kwargs)


def global_freezing() -> contextlib.AbstractContextManager:
    """The context a freezing variant's calls run in: Inductor's global freezing flag."""
    return torch._inductor.config.patch(freezing=True)


def observed_inductor(model: nn.Module | Callable, stats: dict[str, Any], dynamic: bool | None = None,
                      mode: str | None = None, options: dict[str, Any] | None = None,
                      freezing: bool = False) -> tuple[Callable, Callable[[], contextlib.AbstractContextManager]]:
    """``torch.compile(model, mode=mode, options=options)`` through :class:`ObservedInductor`
    (its graphs go to ``stats["graphs"]``), and the context its calls run in: the global
    freezing flag where ``freezing``."""
    stats["graphs"] = []
    backend = ObservedInductor(mode, options, dynamic, stats["graphs"])
    compiled = torch._dynamo.optimize(backend, dynamic=dynamic)(model)
    return compiled, (global_freezing if freezing else contextlib.nullcontext)


def inductor_variant(variant: str, model: nn.Module | Callable, stats: dict[str, Any], dynamic: bool | None = None,
                     options: dict[str, Any] | None = None) -> tuple[Callable, Callable[[], contextlib.AbstractContextManager]]:
    """One of :data:`INDUCTOR_MODES` (``options`` added to Inductor's, e.g. a probe's flag).

    Freezing variants run under the global freezing flag and get the option too, as a user
    following Inductor's documentation would.
    """
    mode, freezing = _MODES[variant]
    merged = {**({"freezing": True} if freezing else {}), **(options or {})}
    return observed_inductor(model, stats, dynamic, mode=mode, options=merged or None, freezing=freezing)


def frozen_summary(variant: str, stats: dict[str, Any]) -> dict[str, Any]:
    """What a compiled variant froze: ``frozen`` is true when every graph it compiled had its
    weights as constants (Inductor: see :class:`ObservedInductor`; fxopt: the backend's
    ``CompiledGraph.frozen`` in ``stats["reports"]``, with no graph fallen back to plain Inductor)."""
    if "graphs" in stats:
        graphs = stats["graphs"]
        return {"frozen": bool(graphs) and all(g["frozen"] for g in graphs), "graphs": len(graphs),
                "param_inputs": sum(g["param_inputs"] for g in graphs),
                "freezing_flag_at_trace": [g["freezing_flag_at_trace"] for g in graphs]}
    if "reports" in stats:
        inference = [g for g in stats["reports"] if not g.training]
        return {"frozen": bool(inference) and all(g.frozen and not g.fallback for g in inference)}
    return {}


def not_frozen(variant: str, summary: dict[str, Any]) -> str | None:
    """Why ``variant``'s figures are not what it claims (a :data:`MUST_FREEZE` variant whose
    summary is not frozen), or None."""
    if variant in MUST_FREEZE and not summary.get("frozen"):
        return f"{variant} was not frozen: {summary}"
    return None
