"""Where a compiled training step's reserved memory and host time go, variant by variant.

Each variant (``inductor``, ``inductor-ro``, ``fxopt``, ``fxopt-plain``) runs resnet50 (bf16,
channels-last, batch 32, SGD momentum, the whole step compiled) in a fresh process, so the
peak *reserved* memory counts from before the first call. The allocator's history is
recorded over the first call and four steps; at the point of the peak reservation, the live
allocations are grouped by the first fxopt frame that made them (else the nearest Python
frames): what holds the memory fxopt adds. Then: step time (best of 3 x 10 steps), host
time per step and the top CPU ops under the profiler.

    python bench/training_memory.py inductor,inductor-ro,fxopt      # JSON in $OUT/diag.json
    python bench/training_memory.py sound    # small loops, fxopt against eager ($OUT/sound.json)
"""

import collections
import copy
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

OUT = os.environ.get("OUT", "/tmp")


def workload():
    import torchvision

    torch.manual_seed(0)
    model = (
        torchvision.models.resnet50().cuda().to(torch.bfloat16, memory_format=torch.channels_last)
    )
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [
        (
            torch.randn(
                32, 3, 224, 224, device="cuda", generator=g, dtype=torch.bfloat16
            ).contiguous(memory_format=torch.channels_last),
            torch.randint(0, 1000, (32,), device="cuda", generator=g),
        )
        for _ in range(4)
    ]
    return model, batches


def make_step(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for p in model.parameters():
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def analyze(snapshot, top=14):
    tr = snapshot["device_traces"][0]
    live, reserved, allocated = {}, 0, 0
    best = (0, 0, None)
    for _i, e in enumerate(tr):
        a = e["action"]
        if a == "segment_alloc":
            reserved += e["size"]
        elif a == "segment_free":
            reserved -= e["size"]
        elif a == "alloc":
            live[e["addr"]] = e
            allocated += e["size"]
        elif a == "free_completed" and e["addr"] in live:
            allocated -= live.pop(e["addr"])["size"]
        if reserved > best[0]:
            best = (reserved, allocated, dict(live))
    groups = collections.Counter()
    for e in (best[2] or {}).values():
        frames = e.get("frames", [])
        fx = [f for f in frames if "/fxopt/" in f["filename"] or "/patterns/" in f["filename"]]
        key = (
            f"{fx[0]['filename'].split('/')[-1]}:{fx[0]['line']} {fx[0]['name']}"
            if fx
            else " < ".join(
                f"{f['filename'].split('/')[-1]}:{f['line']}"
                for f in frames[:3]
                if f["filename"].endswith(".py")
            )
        )
        groups[key] += e["size"]
    return {
        "max_reserved_MB": best[0] / 1e6,
        "allocated_at_that_point_MB": best[1] / 1e6,
        "top": [(k[:230], round(v / 1e6, 1)) for k, v in groups.most_common(top)],
    }


def child(variant):
    import fxopt

    torch.backends.cudnn.benchmark = True
    model, batches = workload()
    step = make_step(model)
    reports = []
    opts = {"reports": reports}
    if variant == "inductor":
        fn = torch.compile(step)
    elif variant == "inductor-ro":
        fn = torch.compile(step, mode="reduce-overhead")
    elif variant == "fxopt-plain":
        fn = fxopt.compile(step, options={**opts, "cuda_graphs": False})
    elif variant == "fxopt":
        fn = fxopt.compile(step, options=opts)
    torch.cuda.synchronize()
    base_reserved = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    t = time.perf_counter()
    fn(*batches[0]).clone()
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    after_first_reserved = torch.cuda.max_memory_reserved()
    for i in range(4):
        fn(*batches[i % 4]).clone()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    row = {
        "variant": variant,
        "first_s": first,
        "base_reserved_MB": base_reserved / 1e6,
        "max_reserved_first_call_MB": after_first_reserved / 1e6,
        "max_reserved_MB": torch.cuda.max_memory_reserved() / 1e6,
    }
    row["analysis"] = analyze(snap)
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(10):
            fn(*batches[i % 4]).clone()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / 10 * 1e3)
    row["step_ms"] = min(times)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for i in range(3):
            fn(*batches[i % 4])
        row["host_ms"] = (time.perf_counter() - t) / 3 * 1e3
    torch.cuda.synchronize()
    row["cpu_table"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)
    row["graphs"] = [(r.name, r.training, r.no_replay, r.fallback) for r in reports]
    print("ROW " + json.dumps(row))


# ------------------------- soundness experiments (small model) ---------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.l = nn.Linear(8, 5)
        self.d = nn.Dropout(0.0)

    def forward(self, x):
        return self.l(self.d(F.relu(self.bn(self.c(x)))).mean((2, 3)))


def launches(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "cudaGraphLaunch" in e.name)


def loop(case, model, opt, compiled, steps=8):
    g = torch.Generator(device="cuda").manual_seed(5)
    kept = []
    for s in range(steps):
        x = torch.randn(4, 3, 8, 8, device="cuda", generator=g)
        y = torch.randint(0, 5, (4,), device="cuda", generator=g)
        if case == "accumulate":
            out = compiled(x)
            F.cross_entropy(out, y).backward()
            kept.append(out.detach())
        elif case == "twice":
            a, b = compiled(x), compiled(x.flip(0))
            loss = F.mse_loss(a, b.detach() * 0.5) + F.cross_entropy(a + b, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            kept.append(loss.detach())
        elif case == "metric":
            m = compiled(x * 2).sum()  # under grad mode, never backpropagated
            with torch.no_grad():
                model.eval()
                e = compiled(x)
                model.train()
            out = compiled(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            kept += [m.detach(), e, loss.detach()]
        elif case == "autograd_grad":
            out = compiled(x)
            loss = F.cross_entropy(out, y)
            grads = torch.autograd.grad(loss, list(model.parameters()))
            kept += list(grads)
        elif case == "setfalse":
            out = compiled(x)
            F.cross_entropy(out, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            kept.append(out)
        elif case == "lastbatch":
            n = 3 if s % 4 == 3 else 4
            out = compiled(x[:n])
            loss = F.cross_entropy(out, y[:n])
            loss.backward()
            opt.step()
            opt.zero_grad()
            kept.append(loss)
        elif case == "retain":
            out = compiled(x)
            loss = F.cross_entropy(out, y)
            loss.backward(retain_graph=True)
            (loss * 2).backward()
            opt.step()
            opt.zero_grad()
            kept.append(out)
        elif case == "retain_late":  # second backward after the next forward
            out = compiled(x)
            loss = F.cross_entropy(out, y)
            loss.backward(retain_graph=True)
            out2 = compiled(x * 0.5)
            loss2 = F.cross_entropy(out2, y)
            loss.backward()
            loss2.backward()
            opt.step()
            opt.zero_grad()
            kept += [out, out2]
    return kept, [p.detach().clone() for p in model.parameters()] + [
        b.clone() for b in model.buffers()
    ] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


def soundness():
    import fxopt

    res = {}
    for case in (
        "accumulate",
        "setfalse",
        "twice",
        "metric",
        "autograd_grad",
        "lastbatch",
        "retain",
    ):
        try:
            torch._dynamo.reset()
            torch.manual_seed(0)
            base = Net().cuda()
            m1 = copy.deepcopy(base)
            o1 = torch.optim.SGD(m1.parameters(), lr=0.1, momentum=0.9)
            ref = loop(case, m1, o1, m1)
            m2 = copy.deepcopy(base)
            o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
            reports = []
            c = fxopt.compile(m2, options={"reports": reports})
            got = loop(case, m2, o2, c)
            n = launches(lambda case=case, m2=m2, o2=o2, c=c: loop(case, m2, o2, c, steps=2))
            ok = all(
                torch.allclose(a, b, rtol=1e-4, atol=1e-5)
                for a, b in zip(ref[0] + ref[1], got[0] + got[1])
            )
            maxd = max(float((a - b).abs().max()) for a, b in zip(ref[0] + ref[1], got[0] + got[1]))
            bad = [
                i
                for i, (a, b) in enumerate(zip(ref[0] + ref[1], got[0] + got[1]))
                if not torch.allclose(a, b, rtol=1e-4, atol=1e-5)
            ]
            res[case] = {
                "equal": ok,
                "max_diff": maxd,
                "bad": bad[:10],
                "n_kept": len(ref[0]),
                "fallback": [r.fallback for r in reports],
                "launches_2_steps": n,
                "no_replay": [r.no_replay for r in reports],
            }
        except Exception as exc:
            res[case] = {
                "error": f"{type(exc).__name__}: {exc}"[:600],
                "tb": traceback.format_exc()[-2500:],
            }
        print("CASE", case, json.dumps(res[case])[:3000], flush=True)
    return res


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2])
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "sound":
        r = soundness()
        Path(OUT, "sound.json").write_text(json.dumps(r, indent=1))
        sys.exit(0)
    rows = []
    for v in sys.argv[1].split(","):
        p = subprocess.run(
            [sys.executable, __file__, "child", v], capture_output=True, text=True, timeout=300
        )
        line = [out for out in p.stdout.splitlines() if out.startswith("ROW ")]
        row = json.loads(line[0][4:]) if line else {"variant": v, "err": p.stderr[-3000:]}
        rows.append(row)
        print(
            json.dumps({k: v for k, v in row.items() if k not in ("cpu_table",)}, indent=1),
            flush=True,
        )
        if "cpu_table" in row:
            print(row["cpu_table"], flush=True)
        Path(OUT, "diag.json").write_text(json.dumps(rows, indent=1))
