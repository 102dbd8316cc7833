"""The minimizer on its own: contract, bad input, generated graphs."""

from __future__ import annotations

import operator

import pytest
import torch
from broken_passes import BROKEN
from hypothesis import HealthCheck, given, settings

from fxopt.errors import InputError
from fxopt.testing import ZOO, minimize, node_count, pass_breaks, repro_source
from fxopt.testing.strategies import fx_graphs


def test_the_users_graph_is_left_untouched():
    instance = ZOO["residual_conv_bn_relu"].instantiate()
    code, nodes = instance.gm.code, node_count(instance.gm)
    small = minimize(instance.gm, pass_breaks([BROKEN["add_becomes_sub"]]))
    assert instance.gm.code == code and node_count(instance.gm) == nodes
    assert node_count(small) == 3 and "add" in small.code  # two cut inputs and the add


def test_a_check_that_does_not_fail_is_rejected():
    instance = ZOO["mlp"].instantiate()
    with pytest.raises(InputError, match="does not fail"):
        minimize(instance.gm, pass_breaks(["cse", "dce"]))


def test_time_limit_returns_a_failing_graph_early():
    instance = ZOO["attention"].instantiate()
    check = pass_breaks([BROKEN["swap_sub_operands"]])
    small = minimize(instance.gm, check, time_limit=0.0)
    assert check(small)  # nothing tried, but still a failing graph


def sub_becomes_add(gm):
    for node in gm.graph.nodes:
        if node.target in (operator.sub, torch.sub):
            node.target = operator.add


@settings(max_examples=5, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(fx_graphs(15, 30, ops=["relu", "tanh", "sub", "mul", "reshape", "permute", "sum", "linear"]))
def test_generated_graphs_minimize_to_the_buggy_op(gm):
    check = pass_breaks([sub_becomes_add])
    if not check(gm):
        return  # the drawn graph has no sub that matters
    small = minimize(gm, check, time_limit=30)
    assert node_count(small) <= 4, small.code
    assert "sub" in small.code or " - " in small.code


def test_repro_source_names_unimportable_passes():
    instance = ZOO["mlp"].instantiate()
    text = repro_source(instance.gm, instance.inputs, [lambda gm: None])
    assert "is not importable" in text and "PASSES = None" in text
    compile(text, "repro.py", "exec")
