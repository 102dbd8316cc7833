"""LLM-sized graphs: cheaper snapshots must not make rollback less exact. A pass that fails
midway through rewriting a 10k-node graph, after writing a weight through ``.data`` and
the graph's metadata, leaves graph, module tree, tensors and metadata as they were."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import fxopt
from fxopt.models import transformer_stack


def _structure(gm: fx.GraphModule) -> list[tuple]:
    return [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs), sorted(n.meta)) for n in gm.graph.nodes]


def _rewrite_half_then_fail(gm: fx.GraphModule) -> None:
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    for node in calls[: len(calls) // 2]:
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(torch.relu, (node,))
        node.replace_all_uses_with(new, delete_user_cb=lambda user, new=new: user is not new)
    gm.get_submodule("7.q").weight.data.mul_(2)
    gm.get_submodule("9").fc1 = nn.Linear(2, 2)
    gm.meta["touched"] = True
    raise RuntimeError("failed midway")


def test_a_pass_failing_midway_on_a_10k_node_graph_leaves_the_input_intact():
    torch.manual_seed(0)
    model = transformer_stack(834, 4, mlp=2)
    gm = fx.symbolic_trace(model)
    assert len(gm.graph.nodes) >= 10_000
    x = torch.randn(2, 3, 4)
    gm.meta["mine"] = 1
    structure, meta = _structure(gm), dict(gm.meta)
    values = {k: v.clone() for k, v in gm.state_dict().items()}
    tensors = {k: v for k, v in gm.state_dict(keep_vars=True).items()}
    modules = dict(gm.named_modules())
    expected = gm(x)
    with pytest.raises(fxopt.PassError) as info:
        fxopt.PassManager(["cse", _rewrite_half_then_fail]).run(gm, (x,))
    assert info.value.pass_name == "_rewrite_half_then_fail"
    assert _structure(gm) == structure
    assert gm.meta == meta
    assert dict(gm.named_modules()) == modules
    after = gm.state_dict(keep_vars=True)
    assert all(after[k] is t for k, t in tensors.items())
    assert all(torch.equal(v, values[k]) for k, v in gm.state_dict().items())
    x2 = torch.randn(2, 3, 4)
    torch.testing.assert_close(gm(x), expected, rtol=0, atol=0)
    torch.testing.assert_close(gm(x2), model(x2), rtol=0, atol=0)
