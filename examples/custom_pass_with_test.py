"""Write a custom pass together with its equivalence tests.

The pass rewrites ``(x * a) * b`` (``a`` and ``b`` Python numbers) into ``x * (a * b)``.
Below it are its tests, written with ``fxopt.testing``:

* over the model zoo (the ``fx_case`` and ``check_pass`` fixtures of fxopt's pytest
  plugin: every motif in fp32, fp16 and bf16, with each case's inputs and tolerances);
* over random graphs (``fx_graphs`` / ``inputs_for``), where scalar multiplications
  are common, so the rewrite actually fires.

Run the tests:  pytest examples/custom_pass_with_test.py
Run the demo:   python examples/custom_pass_with_test.py
  (it shows a sloppy version of the pass being caught, the first diverging node, and
  the minimized standalone repro that fxopt.testing writes for it)
"""

from __future__ import annotations

import operator
import tempfile
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fxopt
from fxopt.testing import EquivalenceError, check_pass, minimize, node_count, pass_breaks
from fxopt.testing.strategies import fx_graphs, inputs_for


def _scalar_mul(node: fx.Node) -> tuple[fx.Node, float] | None:
    """``(tensor, number)`` if ``node`` is ``tensor * number`` (either order), else None."""
    if node.op != "call_function" or node.target not in (operator.mul, torch.mul) or len(node.args) != 2:
        return None
    a, b = node.args
    if isinstance(a, fx.Node) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return a, b
    if isinstance(b, fx.Node) and isinstance(a, (int, float)) and not isinstance(a, bool):
        return b, a
    return None


@fxopt.register_pass
class MergeScalarMuls(fxopt.Pass):
    """Rewrite (x * a) * b, with a and b Python numbers, as x * (a * b)."""

    name = "merge_scalar_muls"
    preserves = ("shapes",)  # the new node gets the old one's meta['val']

    def run(self, gm: fx.GraphModule, ctx: fxopt.PassContext) -> fxopt.PassResult:
        merged = 0
        for node in list(gm.graph.nodes):
            outer = _scalar_mul(node)
            inner = _scalar_mul(outer[0]) if outer else None
            if inner is None or len(outer[0].users) != 1:  # another user needs x * a itself
                continue
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(operator.mul, (inner[0], inner[1] * outer[1]))
            new.meta["val"] = node.meta.get("val")
            fxopt.record_replacement(new, [outer[0], node], self.name)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            gm.graph.erase_node(outer[0])
            merged += 1
        return fxopt.PassResult(merged > 0, {"merged": merged})


# --- the tests ------------------------------------------------------------------------


@pytest.mark.fxopt_exclude_tags("large")
def test_merge_scalar_muls_on_the_zoo(fx_case, check_pass):
    check_pass(["merge_scalar_muls"], fx_case)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data(), st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_merge_scalar_muls_on_random_graphs(data, dtype):
    gm = data.draw(fx_graphs(1, 20, dtype=dtype, ops=["scalar_arith", "relu", "add", "reshape", "sum"]))
    check_pass(["merge_scalar_muls"], gm, data.draw(inputs_for(gm)))


def test_it_fires_and_shares_are_kept():
    class Scaled(torch.nn.Module):
        def forward(self, x):
            y = x * 2.0
            return (x * 0.5) * 3.0, y * 3.0, y + 1  # only the first pair may merge

    gm = fx.symbolic_trace(Scaled())
    optimized = check_pass(["merge_scalar_muls"], gm, (torch.randn(4),))
    assert fxopt.report_of(optimized).find("merge_scalar_muls")[0].stats == {"merged": 1}


# --- the demo: what a bug looks like ------------------------------------------------------


def sloppy_merge_scalar_muls(gm: fx.GraphModule) -> None:
    """The same rewrite, done in place on the inner node, forgetting its other users."""
    for node in list(gm.graph.nodes):
        outer = _scalar_mul(node)
        inner = _scalar_mul(outer[0]) if outer else None
        if inner is not None:
            outer[0].args = (inner[0], inner[1] * outer[1])
            node.replace_all_uses_with(outer[0])
            gm.graph.erase_node(node)


class Shared(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.proj(x))
        y = h * 2.0
        return y * 3.0 + torch.relu(y)


def main() -> None:
    model, x = Shared().eval(), torch.randn(4, 8)
    gm = fx.symbolic_trace(model)
    print(check_pass(["merge_scalar_muls"], gm, (x,)).code)
    try:
        check_pass([sloppy_merge_scalar_muls], gm, (x,))
    except EquivalenceError as error:
        print(f"caught: {error}\n")
    out = Path(tempfile.mkdtemp(prefix="fxopt-artifacts-"))
    try:  # with artifacts: the minimized graph, a runnable repro and the diff
        check_pass([sloppy_merge_scalar_muls], gm, (x,), artifacts=out, name="sloppy")
    except EquivalenceError:
        print("artifacts:", sorted(p.name for p in (out / "sloppy").iterdir()))
        print((out / "sloppy" / "minimized_graph.py").read_text())
    small = minimize(gm, pass_breaks([sloppy_merge_scalar_muls]), example_inputs=(x,))
    print(f"minimized from {node_count(gm)} to {node_count(small)} nodes")


if __name__ == "__main__":
    main()
