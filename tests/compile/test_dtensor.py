"""A tensor-parallel (DTensor) model through ``backend="fxopt"``: its sharded parameters stay
graph inputs (Inductor cannot freeze tensor subclasses), fxopt's passes run, and the
result matches eager. A real gloo process group of one rank on CPU."""

import warnings

import pytest
import torch
import torch.nn as nn

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = self.up(x)
        h = torch.relu(h) + torch.relu(h)  # a duplicate for cse to merge
        return self.down(self.drop(h))


@pytest.fixture
def mesh(tmp_path):
    """A one-rank gloo group: ours, or the one fxopt.testing.strategies left initialized."""
    if dist.is_initialized():
        assert dist.get_world_size() == 1
        yield DeviceMesh("cpu", [0])
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", world_size=1, rank=0)
    try:
        yield DeviceMesh("cpu", [0])
    finally:
        dist.destroy_process_group()


def test_a_tensor_parallel_model_compiles_with_fxopt_passes_and_matches_eager(mesh):
    torch.manual_seed(0)
    model = MLP().eval()
    tp = parallelize_module(MLP().eval(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    with torch.no_grad():
        for p, q in zip(tp.parameters(), model.parameters()):
            p.copy_(distribute_tensor(q, mesh, p.placements))
    assert all(isinstance(p, DTensor) for p in tp.parameters())
    x = torch.randn(4, 16)
    reports = []
    compiled = torch.compile(tp, backend="fxopt", options={"reports": reports, "strict": True})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fxopt backend")  # no silent fallback
        with torch.no_grad():
            out = compiled(x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    (graph,) = reports
    assert graph.fallback is None and graph.frozen == []  # DTensor parameters stay inputs
    changed = {r.name for _, r in graph.report.walk() if r.changed}
    assert {"remove_dropout", "cse"} <= changed
    assert graph.code.count("torch.relu(") == 1
