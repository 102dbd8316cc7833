"""Bad input to the backend: unknown options, failing passes, strict mode."""

import pytest
import torch
import torch.nn as nn

import fxopt
from fxopt.compile.inductor_pass import InductorPass
from fxopt.testing import assert_equivalent


def _model():
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)).eval()


def exploding(gm):
    raise RuntimeError("boom")


def test_unknown_options_are_named_at_fxopt_compile():
    with pytest.raises(fxopt.PassOptionError, match="bogus") as info:
        fxopt.compile(_model(), options={"bogus": 1, "strict": True})
    assert "known options" in str(info.value) and "strict" not in str(info.value).split("known")[0]
    with pytest.raises(fxopt.PassOptionError, match="not_a_config"):
        fxopt.compile(_model(), options={"inductor": {"not_a_config": 1}})
    with pytest.raises(fxopt.PassOptionError, match="strict"):
        fxopt.compile(_model(), options={"strict": "yes"})
    with pytest.raises(fxopt.PassOptionError, match="turbo"):
        fxopt.compile(_model(), mode="turbo")
    with pytest.raises(fxopt.UnknownPassError, match="csee"):
        fxopt.compile(_model(), passes=["csee"])


def test_a_mode_given_both_as_argument_and_option_is_refused_at_fxopt_compile():
    """The argument is the mode that runs: one the options also name was validated in its
    place, and a bad argument failed at the first call instead."""
    with pytest.raises(fxopt.PassOptionError, match="mode.*given both"):
        fxopt.compile(_model(), options={"mode": "default"}, mode="no-such-mode")
    with pytest.raises(fxopt.PassOptionError, match="mode.*given both"):
        fxopt.compile(_model(), options={"mode": "max-autotune"}, mode="default")
    assert callable(fxopt.compile(_model(), options={"mode": "max-autotune"}))


def test_unknown_options_through_torch_compile_name_them():
    compiled = torch.compile(_model(), backend="fxopt", options={"bogus": 1})
    with pytest.raises(Exception) as info:
        compiled(torch.randn(2, 6))
    chain, exc = [], info.value
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or getattr(exc, "inner_exception", None)
    assert any(isinstance(e, fxopt.PassOptionError) and "bogus" in str(e) for e in chain)


def test_failing_pass_falls_back_to_plain_inductor_with_a_warning():
    model = _model()
    reports = []
    compiled = fxopt.compile(model, passes=["cse", exploding], options={"reports": reports})
    with pytest.warns(RuntimeWarning, match="'exploding'"):
        assert_equivalent(model, compiled, (torch.randn(4, 6),))
    (graph,) = reports
    assert "exploding" in graph.fallback and "boom" in graph.fallback


def test_strict_mode_raises_the_pass_error():
    compiled = fxopt.compile(_model(), passes=[exploding], options={"strict": True})
    with pytest.raises(Exception) as info:
        compiled(torch.randn(4, 6))
    causes, exc = [], info.value
    while exc is not None:
        causes.append(exc)
        exc = exc.__cause__ or getattr(exc, "inner_exception", None)
    assert any(isinstance(e, fxopt.PassError) and e.pass_name == "exploding" for e in causes)


def test_failing_aten_pass_leaves_inductors_graph_as_it_was():
    model = _model()
    compiled = fxopt.compile(model, options={"post_grad_pre_passes": ["cse", exploding]})
    with pytest.warns(RuntimeWarning, match="'exploding'.*post_grad_custom_pre_pass"):
        assert_equivalent(model, compiled, (torch.randn(4, 6),))


def _structure(graph):
    """Ops and wiring, by position (a restored graph may rename nodes)."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    return [(n.op, n.target, torch.fx.map_arg(n.args, index.__getitem__)) for n in graph.nodes]


def test_failing_aten_pass_restores_the_same_graph_object():
    gm = torch.fx.symbolic_trace(_model())
    graph, before = gm.graph, _structure(gm.graph)
    x = torch.randn(2, 6)
    expected = gm(x)

    def rewire_then_fail(gm):
        for node in list(gm.graph.nodes):
            if node.op == "call_module" and node.target == "1":
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
        raise RuntimeError("half done")

    with pytest.warns(RuntimeWarning, match="rewire_then_fail"):
        InductorPass(["dce", rewire_then_fail])(graph)
    assert gm.graph is graph and _structure(graph) == before
    torch.testing.assert_close(gm(x), expected)
    with pytest.raises(fxopt.PassError, match="half done"):
        InductorPass([rewire_then_fail], strict=True)(graph)


@torch.library.custom_op("fxopt_test::relu_without_fake", mutates_args=())
def relu_without_fake(x: torch.Tensor) -> torch.Tensor:
    """Runs in eager, but has no fake implementation: AOTAutograd cannot trace it."""
    return torch.relu(x)


def to_untraceable_relu(gm):
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.relu:
            node.target = torch.ops.fxopt_test.relu_without_fake.default


class ReluNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) * 2)


def test_graph_inductor_cannot_compile_falls_back_naming_the_passes():
    model = ReluNet().eval()
    reports = []
    compiled = fxopt.compile(model, passes=[to_untraceable_relu], options={"reports": reports})
    with pytest.warns(RuntimeWarning, match="Inductor failed.*to_untraceable_relu"):
        assert_equivalent(model, compiled, (torch.randn(4, 6),))
    (graph,) = reports
    assert "to_untraceable_relu" in graph.fallback and "relu_without_fake" in graph.code


def doubles_the_output(gm):
    """A wrong rewrite: the graph it leaves computes twice the original."""
    output = gm.graph.output_node()
    (result,) = output.args[0]
    with gm.graph.inserting_before(output):
        doubled = gm.graph.call_function(torch.mul, (result, 2))
    output.args = ((doubled,),)


def test_verify_catches_a_wrong_pass_and_the_graph_falls_back():
    model = _model()
    reports = []
    compiled = fxopt.compile(model, passes=["cse", doubles_the_output],
                             options={"verify": True, "reports": reports})
    with pytest.warns(RuntimeWarning, match="'doubles_the_output'.*not equivalent"):
        assert_equivalent(model, compiled, (torch.randn(4, 6),))
    assert "doubles_the_output" in reports[0].fallback
