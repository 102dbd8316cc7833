"""After torch.compile(backend="fxopt"): Inductor's kernels attributed to FX nodes (CPU)."""

import pytest
import torch
import torch.nn as nn

from fxopt.profiling import profile_compiled


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 128), nn.Linear(128, 16)

    def forward(self, x):
        y = torch.relu(self.fc1(x)) * 2
        return self.fc2(y).softmax(-1)


def test_kernels_name_the_fx_nodes_they_compute():
    torch._dynamo.reset()
    with torch.no_grad():
        result = profile_compiled(Small().eval(), (torch.randn(8, 64),), warmup=1, repeat=2)
    assert result.warnings == []
    graph = result.graphs[0]
    nodes = {line.split(" = ")[0].strip() for line in graph.code.splitlines() if " = " in line}
    covered = result.by_node()
    # every kernel covers nodes of the torch-level graph fxopt handed to Inductor
    assert result.kernels and all(k.nodes and set(k.nodes) <= nodes for k in result.kernels)
    # the softmax is computed by a generated C++ kernel, the linears by extern GEMMs
    assert any(name.startswith("cpp_fused") for name in covered["softmax"])
    assert all(k.calls == 1 and k.time_s > 0 for k in result.kernels)
    assert sum(k.share for k in result.kernels) == pytest.approx(1.0)
