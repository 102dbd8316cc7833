"""The in-place stress set: at least one case per rule R1-R15 of inplace-rules.md.

Every case states how many ops must be converted and, for the hazards, which rule must
reject. Every case is then run four ways: the converted graph must be bitwise equal to
the original model on fresh random inputs; inputs and parameters must stay bit-identical;
the conversion must survive ``dce``; and with grad on, ``backward()`` must work and give
the original gradients.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import fxopt
from fxopt.analysis.ops import inplace_variant


@dataclass
class Case:
    name: str
    model: Callable[[], nn.Module]
    inputs: Callable[[int], tuple]
    converted: int
    #: a rule that must reject at least one candidate in this case
    rule: str | None = None
    aten: bool = False  # capture with make_fx (ATen ops) instead of symbolic_trace


class Fn(nn.Module):
    """A module around a function, with an optional parameter ``w``."""

    def __init__(self, fn: Callable, w: torch.Tensor | None = None, buffer: torch.Tensor | None = None):
        super().__init__()
        self.fn = fn
        if w is not None:
            self.w = nn.Parameter(w)
        if buffer is not None:
            self.register_buffer("b", buffer)

    def forward(self, x):
        return self.fn(self, x)


class Fn2(Fn):
    def forward(self, x, y):
        return self.fn(self, x, y)


def randn(*shape):
    return lambda seed: tuple(torch.randn(s, generator=torch.Generator().manual_seed(seed + i))
                              for i, s in enumerate(shape))


def inference_randn(*shape):
    def make(seed):
        with torch.inference_mode():
            return randn(*shape)(seed)
    return make


def fn_case(name, fn, shapes, converted, rule=None, w=None, buffer=None, aten=False):
    cls = Fn if len(shapes) == 1 else Fn2
    return Case(name, lambda: cls(fn, None if w is None else w.clone(), buffer), randn(*shapes),
                converted, rule, aten)


class SharedReLU(nn.Module):
    """One nn.ReLU called twice, as torchvision's BasicBlock does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.relu = nn.ReLU()

    def forward(self, x):
        y = self.relu(self.lin(x))
        return self.relu(self.lin(y) + y)


class ActivationModules(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.acts = nn.Sequential(nn.ReLU6(), nn.SiLU(), nn.Hardswish(), nn.LeakyReLU(0.1), nn.ELU(),
                                  nn.GELU())

    def forward(self, x):
        return self.acts(self.lin(x))


class InferenceBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        with torch.inference_mode():
            self.table = nn.Parameter(torch.randn(6), requires_grad=False)

    def forward(self, x):
        return self.table * 2 + x


def _chunk_relu_both(m, x):
    p, q = (x * 2).chunk(2)
    return torch.relu(p) + q


def _chunk_relu_alone(m, x):
    p, _ = (x * 2).chunk(2)
    return torch.relu(p) * 3


def _view_read_later(m, x):
    y = x * 2
    v = y.view(-1)
    z = torch.relu(y)
    return z + v.sum()


def _partial_overlap(m, x):
    y = x * 2
    return y[1:] + y[:-1]


CASES = [
    # R1 graph inputs
    fn_case("r1_input", lambda m, x: torch.relu(x), [(4, 6)], 0, "R1"),
    fn_case("r1_view_of_input", lambda m, x: x.view(-1).add(1), [(4, 6)], 0, "R1"),
    fn_case("r1_input_first_operand_swapped", lambda m, x: x + torch.sigmoid(x * 3), [(4, 6)], 1),
    # R2 parameters, buffers, module internals
    fn_case("r2_parameter", lambda m, x: torch.relu(m.w) + x, [(4, 6)], 0, "R2", w=torch.randn(4, 6)),
    # symbolic_trace folds buffer arithmetic into a _tensor_constant get_attr: still R2
    fn_case("r2_buffer_constant", lambda m, x: m.b.view(2, 3).mul(2) + x, [(2, 3)], 0, "R2",
            buffer=torch.randn(6)),
    # R3 later reads through aliases
    fn_case("r3_view_read_later", _view_read_later, [(4, 6)], 0, "R3"),
    fn_case("r3_reshape_aliases", lambda m, x: (lambda y: torch.relu(y) * y.reshape(-1).sum())(x * 2),
            [(4, 6)], 0, "R3"),
    fn_case("r3_reshape_copies", lambda m, x: (lambda y: (y.t().reshape(-1), torch.relu(y)))(x * 2),
            [(4, 6)], 1),
    fn_case("r3_contiguous_aliases", lambda m, x: (lambda y: torch.relu(y) + y.contiguous().sum())(x * 2),
            [(4, 6)], 0, "R3"),
    fn_case("r3_contiguous_copies", lambda m, x: (lambda y: (lambda c: torch.relu(y) + c.sum())(
        y.t().contiguous()))(x * 2), [(4, 6)], 1, "R9"),
    fn_case("r3_transpose_read_later", lambda m, x: (lambda y: torch.sigmoid(y) @ y.t())(x * 2),
            [(4, 4)], 0, "R3"),
    # R4 outputs
    fn_case("r4_output", lambda m, x: (lambda y: (y, torch.relu(y)))(x * 2), [(4, 6)], 0, "R4"),
    fn_case("r4_output_view", lambda m, x: (lambda y: (y[0], torch.tanh(y)))(x * 2), [(4, 6)], 0, "R4"),
    # R5 broadcasting: shape, not numel
    # [6] + [1,6]: not into the [6] operand (R5), but into the [1,6] one
    fn_case("r5_broadcast_6_plus_1x6", lambda m, x, y: (x * 2) + (y * 2), [(6,), (1, 6)], 1, "R5"),
    fn_case("r5_broadcast_1_plus_4", lambda m, x, y: (x * 2) + (y * 2), [(1,), (4,)], 1),
    fn_case("r5_other_broadcasts_into_self", lambda m, x, y: (x * 2) * y, [(4, 6), (6,)], 1),
    # R6 self read through another argument
    fn_case("r6_square", lambda m, x: (lambda a: a * a)(x * 2), [(4, 6)], 0, "R6"),
    fn_case("r6_transpose", lambda m, x: (lambda a: a + a.t())(x * 2), [(5, 5)], 0, "R6"),
    fn_case("r6_partial_overlap", _partial_overlap, [(6,)], 0, "R6"),
    # R7 internal overlap
    fn_case("r7_expanded_self", lambda m, x: (x * 2).expand(4, 6).add(1), [(1, 6)], 0, "R7"),
    # R8 dtype
    fn_case("r8_f32_plus_f64", lambda m, x, y: (x * 2) + y.double(), [(4, 6), (4, 6)], 1, "R8"),
    fn_case("r8_ge_keeps_float", lambda m, x: torch.ge(x * 2, 0.5), [(4, 6)], 0, "R8"),
    fn_case("r8_int_plus_float", lambda m, x: (x * 10).long() + 0.5, [(4, 6)], 0, "R8"),
    # R9 autograd: tensors saved for backward
    fn_case("r9_sigmoid_result_saved", lambda m, x: torch.sigmoid(x * 2) + 1, [(4, 6)], 1, "R9"),
    fn_case("r9_mul_saves_operand", lambda m, x: (lambda a: (a * m.w) + 1)(x * 2), [(4, 6)], 1, "R9",
            w=torch.randn(4, 6)),
    # R10 inference tensors
    # inputs created under inference_mode (a buffer made there: see the R10 unit test below)
    Case("r10_inference_input", lambda: Fn(lambda m, x: (x * 2) + x), inference_randn((6,)), 1, "R1"),
    # a chain of activations: each in-place one saves its result, so the next may not write it
    fn_case("r9_activation_chain", lambda m, x: torch.tanh(torch.relu(x * 2)), [(4, 6)], 1, "R9"),
    # R11 no in-place variant
    fn_case("r11_gelu_softmax_pow", lambda m, x: torch.softmax(F.gelu(x * 2), -1).pow(2), [(4, 6)], 0),
    Case("r11_activation_modules", ActivationModules, randn((3, 8)), 3, "R9"),
    # R12 multi-output views
    fn_case("r12_chunk_sibling_read_later", _chunk_relu_both, [(4, 6)], 0, "R3"),
    fn_case("r12_chunk_alone_under_autograd", _chunk_relu_alone, [(4, 6)], 0, "R12"),
    fn_case("r12_max_dim_values", lambda m, x: torch.relu(torch.max(x * 2, dim=1)[0]), [(4, 6)], 1),
    # R13 dead results
    fn_case("r13_unused_result", lambda m, x: (lambda a: (torch.relu(a), a)[1])(x * 2), [(4, 6)], 0, "R4"),
    # R14 elementwise only (ATen graphs)
    fn_case("r14_aten_tril_not_pointwise", lambda m, x: torch.tril(x * 2) * 3, [(4, 4)], 1, aten=True),
    fn_case("r14_aten_pointwise_chain", lambda m, x: torch.relu(x * 2 + 1).sigmoid(), [(4, 6)], 2, "R9",
            aten=True),
    # torch-level spellings
    Case("shared_relu_module", SharedReLU, randn((3, 8)), 3),
    fn_case("functional_inplace_flags", lambda m, x: F.hardswish(F.silu(F.relu6(x * 2))), [(4, 6)], 2,
            "R9"),
    fn_case("add_with_alpha_not_commutative", lambda m, x: torch.add(x, x * 2, alpha=3), [(4, 6)], 0, "R1"),
    fn_case("method_mul_swapped", lambda m, x: x.mul(x.exp()), [(4, 6)], 0, "R9"),
    fn_case("existing_inplace_op", lambda m, x: torch.relu((x * 2).add_(1)), [(4, 6)], 1),
    fn_case("sub_not_commutative", lambda m, x: operator.sub(x, torch.tanh(x)), [(4, 6)], 0, "R1"),
]


def capture(case: Case, model: nn.Module) -> fx.GraphModule:
    if case.aten:
        return make_fx(model)(*case.inputs(0))
    return fx.symbolic_trace(model)


#: Python's in-place operators (``x += y`` traces to ``operator.iadd``)
_IN_PLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ipow,
                       operator.iand, operator.ior, operator.ixor, operator.ifloordiv, operator.imod}


def writes_in_place(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` is an in-place call by torch's own spelling (a trailing ``_``, a
    mutable ATen schema, ``inplace=True``, an in-place operator), read off the graph
    without asking fxopt (its op-facts model or the pass's own marks)."""
    target = node.target
    if node.op == "call_method":
        return target.endswith("_") and not target.startswith("_")
    if node.op == "call_module":
        return getattr(gm.get_submodule(target), "inplace", False) is True
    if node.op != "call_function":
        return False
    if node.kwargs.get("inplace") is True or target in _IN_PLACE_OPERATORS:
        return True
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    name = getattr(target, "__name__", "")
    return name.endswith("_") and not name.startswith("_")


def converted_nodes(gm: fx.GraphModule) -> list[str]:
    """The nodes of ``gm`` that write in place: the pass's conversions, plus any the
    model had already (count them on the graph before the pass, too)."""
    return [n.name for n in gm.graph.nodes if writes_in_place(gm, n)]


def run(gm_or_model, inputs, grad=False):
    inputs = tuple(x.clone().requires_grad_(grad and x.is_floating_point()) for x in inputs)
    with torch.set_grad_enabled(grad):
        out = gm_or_model(*inputs)
    return inputs, out


def leaves(out):
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


@pytest.fixture(params=CASES, ids=[c.name for c in CASES])
def case(request):
    return request.param


def test_converts_what_it_should(case: Case):
    torch.manual_seed(0)
    model = case.model()
    captured = capture(case, model)
    already = len(converted_nodes(captured))
    gm = fxopt.optimize(captured, passes=["inplace"], example_inputs=case.inputs(0))
    stats = fxopt.report_of(gm).find("inplace")[0].stats
    assert stats["converted"] == case.converted, stats
    assert len(converted_nodes(gm)) - already == case.converted  # on the graph, not the pass's word
    if case.rule is not None:
        assert stats["rejected_by_rule"].get(case.rule, 0) >= 1, stats


def test_bitwise_equal_and_inputs_params_untouched(case: Case):
    torch.manual_seed(0)
    model = case.model()
    gm = fxopt.optimize(capture(case, model), passes=["inplace"], example_inputs=case.inputs(0))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for seed in (1, 2):
        inputs = case.inputs(seed)
        kept = tuple(x.clone() for x in inputs)
        with torch.no_grad():
            want = model(*tuple(x.clone() for x in inputs))
            got = gm(*inputs)
        for w, g in zip(leaves(want), leaves(got), strict=True):
            assert torch.equal(w, g)
        for x, k in zip(inputs, kept):
            assert torch.equal(x, k), "an input was written"
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), f"parameter {k} was written"


def test_survives_dce(case: Case):
    torch.manual_seed(0)
    model = case.model()
    captured = capture(case, model)
    already = len(converted_nodes(captured))
    gm = fxopt.optimize(captured, passes=["inplace", "dce"], example_inputs=case.inputs(0))
    assert len(converted_nodes(gm)) - already == case.converted
    inputs = case.inputs(3)
    with torch.no_grad():
        for w, g in zip(leaves(model(*inputs)), leaves(gm(*inputs)), strict=True):
            assert torch.equal(w, g)


def test_backward_under_grad(case: Case):
    if case.aten:
        pytest.skip("make_fx graphs are traced without autograd")
    torch.manual_seed(0)
    model = case.model()
    gm = fxopt.optimize(capture(case, model), passes=["inplace"], example_inputs=case.inputs(0))
    ref_inputs, ref_out = run(model, case.inputs(4), grad=True)
    inputs, out = run(gm, case.inputs(4), grad=True)
    diff = [t for t in leaves(out) if t.requires_grad]
    ref_diff = [t for t in leaves(ref_out) if t.requires_grad]
    assert len(diff) == len(ref_diff)
    if not diff:  # e.g. a comparison's bool output: nothing to differentiate, as in eager
        return
    sum(t.float().sum() for t in diff).backward()  # must not raise a version-counter error
    sum(t.float().sum() for t in ref_diff).backward()
    for a, b in zip(ref_inputs, inputs, strict=True):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-6)


def test_stress_set_covers_every_rule():
    import fxopt.passes.inplace as ip

    named = {c.rule for c in CASES} | {"R11", "R14", "R15"}
    assert {f"R{i}" for i in range(1, 16)} <= named | {"R10", "R13"}
    assert len(CASES) >= 30
    # R15 is the storage merge, checked in test_plan; R16 (collectives in flight) runs on
    # a real process group in tests/soundness/test_collectives.py
    assert len(ip.RULES) == 15


def test_r10_rule_flags_inference_storage():
    """R10 is shadowed by R2 for buffers; the rule itself must still see the storage."""
    import fxopt.passes.inplace as ip
    from fxopt.analysis.alias import AliasInfo
    from fxopt.context import PassContext

    gm = fx.symbolic_trace(InferenceBuffer())
    ctx = PassContext(gm, (torch.randn(6),))
    alias: AliasInfo = ctx.analysis("alias")
    facts = ip.Facts(gm=gm, order=dict(ctx.analysis("topo")), alias=alias,
                     classes=ip.StorageClasses(alias), saved={}, autograd_safe=False,
                     inference_storages=ip._inference_storages(gm, ctx))
    mul = next(n for n in gm.graph.nodes if n.target is operator.mul)
    candidate = ip.Candidate(mul, mul.args[0], inplace_variant(mul, gm))
    assert ip.r10_inference_tensors(candidate, facts) is not None


def test_r13_unused_inplace_result_is_kept_by_dce():
    """torch's eliminate_dead_code drops an unused relu_; fxopt's dce must keep it."""
    gm = fx.symbolic_trace(Fn(lambda m, x: (lambda a: (torch.relu_(a), a * 1)[1])(x * 2)))
    out = fxopt.optimize(gm, passes=["dce"], example_inputs=(torch.randn(3),))
    assert any(n.target is torch.relu_ for n in out.graph.nodes)
    x = torch.randn(3)
    assert torch.equal(out(x), torch.relu(x * 2))


def test_autograd_safe_off_converts_saved_tensors():
    gm = fx.symbolic_trace(Fn(lambda m, x: torch.sigmoid(x * 2) + 1))
    out = fxopt.optimize(gm, passes=["inplace{autograd_safe=false}"], example_inputs=(torch.randn(4),))
    assert len(converted_nodes(out)) == 2  # sigmoid_ and the += into its saved result
    x = torch.randn(4)
    with torch.no_grad():
        assert torch.equal(out(x), torch.sigmoid(x * 2) + 1)


def test_module_copies_leave_the_users_model_alone():
    model = SharedReLU()
    gm = fxopt.optimize(model, passes=["inplace"], example_inputs=(torch.randn(3, 8),), inplace=True)
    assert model.relu.inplace is False
    assert any(isinstance(m, nn.ReLU) and m.inplace for m in gm.modules())


def test_missing_shapes_needs_example_inputs():
    gm = fx.symbolic_trace(Fn(lambda m, x: torch.relu(x * 2)))
    with pytest.raises(fxopt.FxoptError, match="example"):
        fxopt.optimize(gm, passes=["inplace"])
