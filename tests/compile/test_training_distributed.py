"""Training on two ranks through ``backend="fxopt"``: DDP (split at gradient buckets by
Dynamo's DDPOptimizer) and FSDP2 (``fully_shard`` per block and on the whole model), on CPU
with gloo. Each rank trains the eager model and the compiled one from the same weights on
its own batches; the losses, the updated weights and the reports are compared here."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WRAPPINGS = ("ddp", "fsdp-block", "fsdp-model")


class Block(nn.Module):
    def __init__(self, d=192):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(192, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _wrap(model, how):
    if how == "ddp":  # 1 MB buckets (as small as the first): the DDPOptimizer splits the graph,
        return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)  # each piece through fxopt
    from torch.distributed.fsdp import fully_shard

    if how == "fsdp-block":
        for block in model.blocks:
            fully_shard(block)
    return fully_shard(model)


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _worker(rank, init, out):
    import fxopt  # noqa: F401 - registers the backend in the spawned process

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    torch.manual_seed(0)
    base = Net()
    gen = torch.Generator().manual_seed(10 + rank)
    batches = [(torch.randn(8, 192, generator=gen), torch.randint(0, 4, (8,), generator=gen)) for _ in range(3)]
    result = {}
    for how in WRAPPINGS:
        runs = {}
        for compiler in ("eager", "fxopt"):
            torch._dynamo.reset()
            model = _wrap(copy.deepcopy(base), how)
            reports = []
            fn = model if compiler == "eager" else torch.compile(
                model, backend="fxopt", options={"reports": reports, "strict": True})
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            losses = []
            for x, y in batches:
                loss = F.cross_entropy(fn(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            runs[compiler] = {"losses": losses, "params": [_full(p).flatten().tolist() for p in model.parameters()],
                              "graphs": [{"training": r.training, "fallback": r.fallback, "no_replay": r.no_replay}
                                         for r in reports]}
        result[how] = runs
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gloo_training")
    # the ranks unpickle _worker by this module's name (tests.compile...), so they import it
    # from the repository root, which plain `pytest` (unlike `python -m pytest`) leaves off
    # sys.path; spawn hands the parent's sys.path to its children
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
        torch.multiprocessing.spawn(_worker, args=(str(tmp / "init"), str(tmp)), nprocs=2, join=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("how", WRAPPINGS)
def test_training_through_the_backend_matches_eager_on_every_rank(ranks, how):
    for rank in ranks:
        eager, compiled = rank[how]["eager"], rank[how]["fxopt"]
        torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]),
                                   rtol=1e-5, atol=1e-6)
        for p, q in zip(compiled["params"], eager["params"]):
            torch.testing.assert_close(torch.tensor(p), torch.tensor(q), rtol=1e-5, atol=1e-6)
        graphs = compiled["graphs"]
        assert graphs and any(g["training"] for g in graphs)
        assert all(g["fallback"] is None for g in graphs)  # fxopt ran on every graph: no silent fallback
        # and says why nothing is replayed: FSDP re-allocates its parameters every step
        reason = "FSDP-managed" if how.startswith("fsdp") else "is on cpu"
        assert all(reason in g["no_replay"] for g in graphs if g["training"]), graphs
    # the ranks saw different batches yet hold the same weights: the gradients were reduced
    for p, q in zip(ranks[0][how]["fxopt"]["params"], ranks[1][how]["fxopt"]["params"]):
        assert p == q


def test_ddp_buckets_split_the_graph_into_pieces_each_compiled_by_fxopt(ranks):
    for rank in ranks:
        assert len([g for g in rank["ddp"]["fxopt"]["graphs"] if g["training"]]) > 1
