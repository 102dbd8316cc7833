"""Fast start: ``import fxopt`` and a pass lookup load nothing heavy, the first optimize
with the default pipeline loads neither ``torch._dynamo`` nor sympy (its shapes come from
fxopt's own rules), any other first optimize loads nothing beyond torch's own
first-FakeTensor cost, and the lazy pass table agrees with what the pass modules register.
Each check runs in a fresh interpreter, because this test process has long since imported
everything."""

import importlib
import importlib.util
import subprocess
import sys

import pytest

HEAVY = ("torch._inductor", "torch._dynamo", "triton", "numba", "sympy", "hypothesis",
         "networkx", "graphviz", "tabulate")


def _heavy_loaded_after_each(steps: list[str]) -> list[set[str]]:
    """Run ``steps`` in one fresh interpreter; the heavy modules loaded after each."""
    lines = ["import sys", f"HEAVY = {HEAVY!r}"]
    for step in steps:
        lines += [step, "print(' '.join(m for m in HEAVY if m in sys.modules) + '|')"]
    out = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True,
                         check=True)
    return [set(chunk.split()) for chunk in out.stdout.split("|")[:-1]]


def test_import_and_lookup_load_nothing_heavy_and_inductor_learns_the_fused_ops_later():
    loaded = _heavy_loaded_after_each([
        "import fxopt",
        "fxopt.get_pass_class('dce')",
        "fxopt.PassManager(['remove_dropout', 'cse', 'dce', 'inplace', 'plan_memory'])",
        "fxopt.PassManager(list(fxopt.DEFAULT_PIPELINE))",  # imports fxopt.compile.fused_ops
        "import torch\n"
        "from torch._inductor.decomposition import decompositions\n"
        "assert torch.ops.fxopt.add_relu.default in decompositions",
    ])
    assert loaded[:4] == [set()] * 4
    assert "torch._inductor" in loaded[4]


def test_small_memory_plans_do_not_load_numba():
    loaded = _heavy_loaded_after_each([
        "import torch, fxopt\n"
        "from fxopt.models import demo_model\n"
        "model, inputs = demo_model()\n"
        "gm = fxopt.optimize(model, ['plan_memory'], example_inputs=inputs)\n"
        "assert fxopt.report_of(gm).records[0].stats['arena_bytes'] > 0",
    ])
    assert "numba" not in loaded[0]


def test_first_default_optimize_of_a_conv_net_loads_neither_dynamo_nor_sympy():
    # torch's FakeTensorMode() imports torch._dynamo (about a second of CPU on the first call)
    # and its Python meta kernels do too; a meta convolution imports sympy. The default
    # pipeline needs no FakeTensors, and the demo's ops all have shape rules of fxopt's own.
    loaded = _heavy_loaded_after_each([
        "import torch, fxopt\n"
        "from fxopt.models import demo_model\n"
        "model, inputs = demo_model()\n"
        "gm = fxopt.optimize(torch.fx.symbolic_trace(model), example_inputs=inputs)\n"
        "assert [r.name for r in fxopt.report_of(gm).records] == list(fxopt.DEFAULT_PIPELINE)\n"
        "assert fxopt.report_of(gm).records[3].changed  # fuse_conv_bn_relu fused (shapes were there)\n"
        "assert all(n.meta['val'].is_meta for n in gm.graph.nodes)",
    ])
    assert not loaded[0] & {"torch._dynamo", "sympy", "torch._inductor"}


@pytest.mark.parametrize("capture", ["symbolic_trace", "export"])
def test_first_default_optimize_of_a_transformer_loads_neither_dynamo_nor_sympy(capture):
    # layer norm, linears, SDPA, GELU: their meta kernels import torch._dynamo, fxopt's shape
    # rules do not. torch.export itself imports Dynamo, so that capture is checked for sympy's
    # and Inductor's absence beyond what exporting loaded.
    loaded = _heavy_loaded_after_each([
        "import torch, fxopt\n"
        "import torch.nn as nn, torch.nn.functional as F\n"
        "class Block(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.ln, self.q, self.k, self.v = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        y = self.ln(x)\n"
        "        a = F.scaled_dot_product_attention(self.q(y).view(2, 3, 2, 4).transpose(1, 2),\n"
        "                                           self.k(y).view(2, 3, 2, 4).transpose(1, 2),\n"
        "                                           self.v(y).view(2, 3, 2, 4).transpose(1, 2), is_causal=True)\n"
        "        return x + F.gelu(a.transpose(1, 2).reshape(2, 3, 8)).softmax(-1)\n"
        "model, inputs = nn.Sequential(Block(), Block()).eval(), (torch.randn(2, 3, 8),)\n"
        + ("gm = torch.fx.symbolic_trace(model)" if capture == "symbolic_trace" else
           "gm = torch.export.export(model, inputs).module()"),
        "out = fxopt.optimize(gm, example_inputs=inputs)\n"
        "assert all(n.meta['val'].is_meta for n in out.graph.nodes if isinstance(n.meta.get('val'), torch.Tensor))",
        "torch.testing.assert_close(out(*inputs), model(*inputs))",  # imports sympy itself
    ])
    assert not (loaded[1] - loaded[0]) & {"torch._dynamo", "sympy", "torch._inductor"}


def test_first_optimize_loads_only_fxopt_torch_and_the_standard_library_beyond_torchs_fake_mode():
    # torch's first FakeTensorMode() imports torch._dynamo (and with it sympy and parts of
    # Inductor): a cost any shape propagation pays, meta tensors included (their Python
    # kernels import torch._dynamo too; bench/startup.py measures both). Paid first here, so
    # what the default pipeline's first run adds on top is fxopt's own choice.
    code = "\n".join([
        "import sys, torch",
        "from torch._subclasses.fake_tensor import FakeTensorMode",
        "FakeTensorMode()",
        "before = set(sys.modules)",
        "import fxopt",
        "from fxopt.models import demo_model",
        "model, inputs = demo_model()",
        "gm = fxopt.optimize(torch.fx.symbolic_trace(model), example_inputs=inputs)",
        "assert fxopt.report_of(gm).records[0].name == 'remove_dropout'",
        "print(' '.join(sorted({m.split('.')[0] for m in set(sys.modules) - before})))",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    packages = set(out.stdout.split())
    assert "fxopt" in packages  # the probe saw the modules the run loaded
    assert packages - {"fxopt", "torch"} <= set(sys.stdlib_module_names)


def test_registering_every_pass_loads_neither_dynamo_nor_inductor():
    loaded = _heavy_loaded_after_each(["import fxopt\nfxopt.registered_passes()"])
    assert not loaded[0] & {"torch._dynamo", "torch._inductor"}


def test_builtin_pass_table_matches_what_the_modules_register():
    from fxopt.registry import BUILTIN_PASSES, registered_passes

    for module in set(BUILTIN_PASSES.values()):
        importlib.import_module(module)
    stock = {name: cls.__module__ for name, cls in registered_passes().items()
             if cls.__module__.startswith("fxopt.")}
    assert stock == BUILTIN_PASSES
