"""Adversarial fuzzing: every stock pass and the default pipeline keep eager's outputs
*and* side effects on random graphs full of effects.

The graphs (``fx_graphs(effects=True)``) mix pure ops with training-mode batch norm and
dropout, ``fx.wrap``'d calls with an effect outside tensors, mutating custom ops called
through their packet and overloads, in-place writes into inputs and buffers, view chains,
buffers written after being read, and functional collectives on a one-rank gloo group.
Compared after one call of each: outputs, input contents, buffer contents, the wrapped
function's call log, and the sequence of collectives. A typed ``FxoptError`` (a pass
refusing) is allowed; anything else is a bug. CI runs a small profile; FXOPT_PROFILE=long
runs 10,000 examples.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fxopt
from fxopt.testing import strategies
from fxopt.testing.strategies import fx_graphs, inputs_for

LONG = os.environ.get("FXOPT_PROFILE") == "long"
#: passes that promise equivalence (quantize is lossy by design); layout passes act on CUDA
PASSES = sorted(set(fxopt.registered_passes()) - {"quantize"})
PIPELINES = [[name] for name in PASSES] + [list(fxopt.DEFAULT_PIPELINE)]


def run(gm: torch.fx.GraphModule, inputs: tuple) -> dict:
    """One call under a fixed seed: its outputs and every effect it had."""
    args = tuple(t.clone() for t in inputs)
    strategies.CALL_LOG.clear()
    torch.manual_seed(1234)
    with torch.no_grad():
        out = gm(*args)
    return {"out": out, "inputs": args, "buffers": {k: v.clone() for k, v in gm.named_buffers()},
            "log": list(strategies.CALL_LOG),
            "collectives": [str(n.target) for n in gm.graph.nodes if "c10d" in str(n.target)]}


def assert_same_effects(eager: dict, optimized: dict, written: set[str]) -> None:
    tol = {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(optimized["out"], eager["out"], **tol, msg="outputs differ")
    torch.testing.assert_close(optimized["inputs"], eager["inputs"], **tol,
                               msg="inputs written differently")
    for name in written:
        assert name in optimized["buffers"], f"buffer {name!r}, written by the program, is gone"
        torch.testing.assert_close(optimized["buffers"][name], eager["buffers"][name], **tol,
                                   msg=f"buffer {name!r} differs")
    assert len(optimized["log"]) == len(eager["log"]), "a wrapped call was dropped or merged"
    torch.testing.assert_close(optimized["log"], eager["log"], **tol)
    assert optimized["collectives"] == eager["collectives"]


@settings(max_examples=10_000 if LONG else 60, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.data(), st.sampled_from(PIPELINES))
def test_passes_keep_outputs_and_side_effects(data, passes):
    gm = data.draw(fx_graphs(1, 16, effects=True))
    inputs = data.draw(inputs_for(gm))
    before = {k: v.clone() for k, v in gm.named_buffers()}
    eager = run(copy.deepcopy(gm), inputs)
    written = {k for k, v in eager["buffers"].items() if not torch.equal(v, before[k])}
    try:
        optimized = fxopt.optimize(copy.deepcopy(gm), passes=passes,
                                   example_inputs=tuple(t.clone() for t in inputs))
    except fxopt.FxoptError:
        return  # a typed refusal is allowed
    assert_same_effects(eager, run(optimized, inputs), written)


def test_effect_kinds_are_all_emitted():
    seen: set[str] = set()
    for seed in range(300):
        choices = torch.randint(0, 256, (16 * 12,), generator=torch.Generator().manual_seed(seed))
        gm = strategies.build_graph(bytes(choices.tolist()), seed,
                                    ops=strategies.OP_KINDS + strategies.EFFECT_KINDS)
        seen.update(gm.meta["fxopt.op_kinds"])
    missing = set(strategies.EFFECT_KINDS) - seen
    assert not missing, f"never emitted: {missing}"
    assert len(strategies.EFFECT_KINDS) >= 7


@pytest.mark.parametrize("kind", strategies.EFFECT_KINDS)
def test_each_effect_kind_runs_and_is_effectful(kind):
    """Each effect kind builds a valid graph that runs, and the op-facts model calls it
    effectful."""
    from fxopt.analysis.ops import is_pure

    # one (3, 3) input, a relu (a fresh, writable value), then the effect
    choices = bytes([0, 1, 2, 2] + [0] * 12 + [1] + [0] * 15 + [0] * 16)
    gm = strategies.build_graph(choices, 0, ops=[kind, "relu"])
    assert gm.meta["fxopt.op_kinds"] == ["relu", kind]
    gm(*[torch.randn(v.meta["val"].shape) for v in gm.graph.nodes if v.op == "placeholder"])
    assert any(not is_pure(n) for n in gm.graph.nodes if n.op not in ("placeholder", "output"))


VIEW_CHAIN_KINDS = ["view", "reshape", "permute", "transpose", "unsqueeze", "slice", "narrow",
                    "select", "split", "chunk", "input_write", "relu", "add", "mul", "sum"]


@pytest.mark.parametrize("passes", PIPELINES, ids=lambda p: "+".join(p) if len(p) == 1 else "default")
def test_writes_through_view_chains(passes):
    """Inputs and buffers written through chains of views (a slice of a transpose of an
    input, ``add_``'d) between pure uses of them: every pipeline keeps the writes, the
    values read before and after them, and the caller's tensors."""
    checked = 0
    for seed in range(12):
        choices = torch.randint(0, 256, (16 * 14,), generator=torch.Generator().manual_seed(seed))
        gm = strategies.build_graph(bytes(choices.tolist()), seed, ops=VIEW_CHAIN_KINDS)
        if "input_write" not in gm.meta["fxopt.op_kinds"]:
            continue
        inputs = tuple(torch.randn(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "placeholder")
        before = {k: v.clone() for k, v in gm.named_buffers()}
        eager = run(copy.deepcopy(gm), inputs)
        written = {k for k, v in eager["buffers"].items() if not torch.equal(v, before[k])}
        try:
            optimized = fxopt.optimize(copy.deepcopy(gm), passes=passes,
                                       example_inputs=tuple(t.clone() for t in inputs))
        except fxopt.FxoptError:
            continue
        assert_same_effects(eager, run(optimized, inputs), written)
        checked += 1
    assert checked >= 6, "too few graphs wrote through a view chain"
