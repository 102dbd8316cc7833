"""Fast start: ``import fxopt`` and a pass lookup load nothing heavy, and the lazy pass
table agrees with what the pass modules register. Each check runs in a fresh interpreter,
because this test process has long since imported everything."""

import importlib
import subprocess
import sys

HEAVY = ("torch._inductor", "torch._dynamo", "triton", "numba", "sympy", "hypothesis",
         "networkx", "graphviz")


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
        "fxopt.PassManager(list(fxopt.DEFAULT_PIPELINE))",  # imports fxopt.fused_ops
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


def test_builtin_pass_table_matches_what_the_modules_register():
    from fxopt.registry import BUILTIN_PASSES, registered_passes

    for module in set(BUILTIN_PASSES.values()):
        importlib.import_module(module)
    stock = {name: cls.__module__ for name, cls in registered_passes().items()
             if cls.__module__.startswith("fxopt.")}
    assert stock == BUILTIN_PASSES
