"""The ``fxopt`` backend's options (``options={...}`` of ``torch.compile``), checked before
anything compiles, and the Inductor config patches they give each graph.

Unknown options raise :class:`~fxopt.errors.PassOptionError` naming them, as do wrong types
and Inductor hooks this torch does not have: a mistake shows at ``fxopt.compile``, not at
the first call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from fxopt.compile.inductor_pass import InductorPass
from fxopt.errors import PassOptionError
from fxopt.manager import PassManager
from fxopt.optimize import DEFAULT_PIPELINE
from fxopt.pipeline import PassLike
from fxopt.report import Report

__all__ = ["INDUCTOR_HOOKS", "BackendOptions"]


#: Inductor config entries the ATen-level pipelines are installed into, by option name
INDUCTOR_HOOKS: dict[str, str] = {
    "post_grad_pre_passes": "post_grad_custom_pre_pass",
    "post_grad_post_passes": "post_grad_custom_post_pass",
    "joint_pre_passes": "joint_custom_pre_pass",
    "joint_post_passes": "joint_custom_post_pass",
}

#: who PassOptionError says an option belongs to
BACKEND = "fxopt backend"


@dataclass(frozen=True)
class BackendOptions:
    """The options of the ``fxopt`` backend (``options={...}`` of ``torch.compile``)."""

    #: torch-level pipeline run on each Dynamo graph (default: fxopt.DEFAULT_PIPELINE)
    passes: Any = None
    #: ATen-level pipelines run inside Inductor (see INDUCTOR_HOOKS)
    post_grad_pre_passes: Any = None
    post_grad_post_passes: Any = None
    joint_pre_passes: Any = None
    joint_post_passes: Any = None
    #: turn parameters/buffers into constants on inference graphs (and use Inductor freezing)
    freeze: bool = True
    #: raise instead of falling back to plain Inductor when a pass fails
    strict: bool = False
    #: check every changing torch-level pass numerically on the graph's example inputs
    verify: bool = False
    #: a list that receives one CompiledGraph per graph the backend compiles
    reports: list | None = None
    #: Inductor config patches, as torch.compile's ``options`` would give them to Inductor
    inductor: Mapping[str, Any] = field(default_factory=dict)
    #: a torch.compile mode ("max-autotune", ...), translated to Inductor options
    mode: str | None = None
    #: replay inference graphs as CUDA graphs where the caller cannot tell (fxopt.compile.replay)
    cuda_graphs: bool = True
    #: the most call shapes of one graph kept captured as CUDA graphs (least recently used
    #: evicted); each holds its input buffers and outputs in the graph's memory pool
    replay_shapes: int = 8
    #: replay training steps (forward, backward, optimizer update) through Inductor's CUDA-graph
    #: trees with plain-call semantics (fxopt.compile.training): None (the default) wherever that is
    #: sound, False never (``cuda_graphs=False`` turns it off too), True the same as None but a
    #: graph that cannot be replayed warns, naming the option and why
    training_cuda_graphs: bool | None = None
    #: also rewrite symbolic-size attention in training graphs (``fxopt.sdpa``'s backward runs
    #: the fused kernels' forward again and differentiates it). Off by default: on an H200, a
    #: BERT-base step at lengths 128/384/256 ran 5-6% slower with it and reserved 11% more
    #: than with torch's SDPA left to Inductor (bench/varlen_training.py): the recomputed
    #: forward costs more than the fused kernels save at these lengths
    sdpa_in_training: bool = False
    #: training graphs: recompute saved activations until each graph's predicted activation
    #: peak is at most this fraction of the stock partition's (fxopt.memory.budget)
    memory_budget: float | None = None

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None = None, mode: str | None = None) -> BackendOptions:
        """Validate ``options`` (unknown keys, types, pipelines) before anything compiles."""
        options = dict(options or {})
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise PassOptionError(BACKEND, ", ".join(unknown),
                                  f"unknown option(s) {unknown}; known options: {', '.join(known)}")
        if mode is not None:
            options.setdefault("mode", mode)
        for key in ("freeze", "strict", "verify", "cuda_graphs", "training_cuda_graphs"):
            if key in options and not isinstance(options[key], bool) and not (
                    key == "training_cuda_graphs" and options[key] is None):
                raise PassOptionError(BACKEND, key, f"expected bool, got {options[key]!r}")
        shapes = options.get("replay_shapes", 1)
        if not isinstance(shapes, int) or isinstance(shapes, bool) or shapes < 1:
            raise PassOptionError(BACKEND, "replay_shapes", f"expected an int >= 1, got {shapes!r}")
        if options.get("reports") is not None and not isinstance(options["reports"], list):
            raise PassOptionError(BACKEND, "reports", "expected a list to append reports to")
        budget = options.get("memory_budget")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int | float)
                                   or not 0 < budget <= 1):
            raise PassOptionError(BACKEND, "memory_budget", f"expected a fraction in (0, 1], got {budget!r}")
        if budget is not None and not hasattr(torch._inductor.config, "custom_partitioner_fn"):
            raise PassOptionError(BACKEND, "memory_budget", f"this torch ({torch.__version__}) has no "
                                  "Inductor hook 'custom_partitioner_fn'")
        inductor = options.get("inductor") or {}
        if not isinstance(inductor, Mapping):
            raise PassOptionError(BACKEND, "inductor", f"expected a dict of Inductor options, got {inductor!r}")
        if budget is not None and "custom_partitioner_fn" in inductor:
            raise PassOptionError(BACKEND, "memory_budget", "the budget is applied through Inductor's "
                                  "custom_partitioner_fn, which inductor={...} sets too: give one of them")
        bad = sorted(k for k in inductor if not _is_inductor_option(k))
        if bad:
            raise PassOptionError(BACKEND, "inductor", f"unknown Inductor option(s) {bad}")
        if options.get("mode") not in (None, "default"):
            try:
                torch._inductor.list_mode_options(options["mode"])
            except RuntimeError as exc:
                raise PassOptionError(BACKEND, "mode", str(exc)) from None
        parsed = cls(**options)
        for key in ("passes", *INDUCTOR_HOOKS):
            pipeline = parsed.pipeline(key)
            if pipeline is not None:
                PassManager(pipeline)  # names, options and ordering are checked here
        missing = [k for k in INDUCTOR_HOOKS if options.get(k) and not hasattr(torch._inductor.config, INDUCTOR_HOOKS[k])]
        if missing:
            raise PassOptionError(BACKEND, missing[0], f"this torch ({torch.__version__}) has no "
                                  f"Inductor hook {INDUCTOR_HOOKS[missing[0]]!r}")
        return parsed

    def pipeline(self, key: str) -> PassLike | None:
        value = getattr(self, key)
        if key == "passes" and value is None:
            return list(DEFAULT_PIPELINE)
        return value or None

    def inductor_patches(self, *, frozen: bool, training: bool,
                         sink: list[tuple[str, Report]] | None = None,
                         budget_sink: list | None = None) -> dict[str, Any]:
        patches: dict[str, Any] = {}
        if self.mode not in (None, "default"):
            patches.update(torch._inductor.list_mode_options(self.mode))
        if frozen:
            patches["freezing"] = True
        if training and self.memory_budget is not None:
            from fxopt.memory.budget import BudgetPartitioner

            patches["custom_partitioner_fn"] = BudgetPartitioner(self.memory_budget, reports=budget_sink)
        for key, config_name in INDUCTOR_HOOKS.items():
            pipeline = self.pipeline(key)
            if pipeline is not None:
                patches[config_name] = InductorPass(pipeline, hook=config_name, training=training,
                                                    strict=self.strict, reports=sink)
        patches.update(self.inductor)
        return patches


def _is_inductor_option(name: str) -> bool:
    import torch._inductor.config as config

    entries = getattr(config, "_config", None)  # ConfigModule's table of every entry
    return name in entries if entries is not None else hasattr(config, name.split(".")[0])

