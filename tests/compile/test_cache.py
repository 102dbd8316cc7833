"""ATen-level fxopt pipelines run as Inductor custom passes without defeating its caches."""

import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import fxopt
from fxopt.compile.inductor_pass import InductorPass
from fxopt.testing import assert_equivalent


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()


def _compile_once(model, options):
    """Compile from scratch as a new process would (Dynamo state gone, disk cache kept)."""
    torch._dynamo.reset()
    counters.clear()
    reports = []
    compiled = fxopt.compile(model, options={**options, "reports": reports})
    assert_equivalent(model, compiled, (torch.randn(3, 8),))
    return reports, dict(counters["inductor"]), dict(counters["aot_autograd"])


def test_second_compile_hits_fx_graph_and_aot_autograd_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = _mlp()
    options = {"freeze": False, "post_grad_pre_passes": ["cse", "dce"], "joint_post_passes": "cse"}

    reports, inductor, aot = _compile_once(model, options)
    assert inductor.get("fxgraph_cache_miss") == 1 and not inductor.get("fxgraph_cache_bypass")
    assert aot.get("autograd_cache_saved") == 1
    hooks = [hook for hook, _ in reports[0].aten_reports]
    assert "post_grad_custom_pre_pass" in hooks and "joint_custom_post_pass" in hooks

    _, inductor, aot = _compile_once(model, options)
    assert inductor.get("fxgraph_cache_hit") == 1 and not inductor.get("fxgraph_cache_miss")
    assert aot.get("autograd_cache_hit") == 1

    # the key does include the pipeline: another ATen pipeline must not reuse the entry
    _, inductor, _ = _compile_once(model, {**options, "post_grad_pre_passes": ["cse"]})
    assert inductor.get("fxgraph_cache_miss") == 1 and not inductor.get("fxgraph_cache_hit")


class ScaleShift(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(8))
        self.shift = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return torch.tanh(x * self.scale.exp() + self.shift)


def test_frozen_inference_graphs_hit_the_fx_graph_cache(tmp_path, monkeypatch):
    # Inductor itself skips the AOTAutograd cache under freezing; its FX graph cache works.
    # (Not with linear layers on CPU: Inductor prepacks their frozen weights into mkldnn
    # tensors, and never caches graphs holding those; on GPU there is no such packing.)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = ScaleShift().eval()
    options = {"post_grad_pre_passes": "cse"}
    reports, inductor, _ = _compile_once(model, options)
    assert reports[0].frozen and inductor.get("fxgraph_cache_miss") == 1
    _, inductor, _ = _compile_once(model, options)
    assert inductor.get("fxgraph_cache_hit") == 1 and not inductor.get("fxgraph_cache_miss")


def test_uuid_is_stable_and_follows_the_pipeline():
    same = InductorPass(["cse", "dce"]).uuid()
    assert same is not None and same == InductorPass("cse,dce").uuid()
    assert same != InductorPass(["dce", "cse"]).uuid()
    assert same != InductorPass(["cse", "dce"], training=True).uuid()
    assert same != InductorPass(["constant_fold{max_bytes=16}", "dce"]).uuid() != \
        InductorPass(["constant_fold{max_bytes=32}", "dce"]).uuid()


def test_pass_without_findable_source_disables_caching_rather_than_reusing():
    code = compile("lambda gm: None", "<prompt>", "eval")
    assert InductorPass([eval(code)]).uuid() is None
