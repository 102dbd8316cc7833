"""One rank of a real 2-process gloo program, optimized by fxopt (run by test_collectives).

Usage: python collectives_worker.py RANK INIT_FILE OUT_JSON
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

import fxopt

aten, c10d = torch.ops.aten, torch.ops._c10d_functional


def program(x):
    group = dist.group.WORLD
    a = funcol.all_reduce(x, "sum", group)
    b = funcol.all_reduce(x, "sum", group)  # identical twin: must not be merged
    funcol.all_reduce(x * 3, "sum", group)  # result unused: must not be dropped
    y = x * 2
    c = funcol.all_reduce(y, "sum", group)
    z = torch.relu(y)  # must not be written into y while c is in flight
    return a + b + c + z


def collectives(gm):
    return [n.target for n in gm.graph.nodes if "_c10d_functional" in str(n.target)]


def delay_last_wait(gm):
    """Move the last wait_tensor to just before its first use (as compute/communication
    overlap does), so that relu runs while the all_reduce of its input is in flight."""
    wait = [n for n in gm.graph.nodes if n.target is c10d.wait_tensor.default][-1]
    first_use = min(wait.users, key=lambda u: list(gm.graph.nodes).index(u))
    first_use.prepend(wait)
    gm.recompile()
    return gm


def _op_name(spelling: str) -> str:
    """``all_reduce`` of ``torch.ops._c10d_functional.all_reduce.default`` and its other spellings."""
    return spelling.split("_c10d_functional.")[-1].split(".")[0].strip()


def training_step(x):
    """``program`` as a trained module through ``backend="fxopt"``: the collectives of the
    graph Dynamo captured against those of the graph handed to Inductor, the loss and the
    gradient against eager, and why the training graph is not replayed."""
    weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, x.numel()))

    def step(x):
        return program(x * weight).square().sum()

    captured = []

    def capture(gm, inputs):
        captured.append([_op_name(str(n.target)) for n in gm.graph.nodes if "_c10d_functional" in str(n.target)])
        return gm.forward

    torch.compile(step, backend=capture)(x)
    eager = step(x)
    eager.backward()
    expected_grad, weight.grad = weight.grad.clone(), None
    torch._dynamo.reset()
    reports = []
    loss = torch.compile(step, backend="fxopt", options={"reports": reports, "strict": True})(x)
    loss.backward()
    (record,) = reports
    return {"captured": captured[0], "compiled": [_op_name(line.split("(")[0]) for line in record.code.splitlines()
                                                  if "_c10d_functional" in line],
            "training": record.training, "no_replay": record.no_replay,
            "equal": bool(torch.allclose(loss, eager) and torch.allclose(weight.grad, expected_grad))}


def main(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(rank)
    x = torch.randn(8)
    gm = delay_last_wait(make_fx(program)(x))
    expected = gm(x.clone())
    report = {"before": [str(t) for t in collectives(gm)]}
    for name, passes in (("cleanup", ["cse", "dce"]), ("inplace", ["inplace"]),
                         ("default", fxopt.DEFAULT_PIPELINE)):
        opt = fxopt.optimize(gm, passes=passes, example_inputs=(x,))
        got = opt(x.clone())
        report[name] = {
            "collectives": [str(t) for t in collectives(opt)],
            "equal": bool(torch.allclose(got, expected)),
            "inplace_ops": [str(n.target) for n in opt.graph.nodes
                            if n.op == "call_function" and str(n.target).endswith("_.default")],
        }
    report["training"] = training_step(x)
    # every collective finished on both ranks before the group goes (the unused
    # all_reduce is never waited on: destroying the group with it in flight aborted a
    # rank under load)
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
