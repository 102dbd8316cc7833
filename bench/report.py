"""The HTML report on real models: its size, how long it takes to write and to load in
headless Chromium, a search, and whether the diffs hold only the real change.

Models: ResNet-50 (torchvision's layout, written out below: torchvision is not a
dependency) captured by ``torch.export`` and by ``symbolic_trace``, and BERT-base
(``transformers``' ``BertModel`` with random weights, sequence 128) when transformers is
installed. The ``stack_*`` models measure how the report scales (issue 39): 128, 512 and
2,048 small blocks (linear, ReLU, dropout, residual add, ReLU; 642, 2,562 and 10,242
nodes), ``symbolic_trace``, optimized with remove_dropout, fuse_add_relu and
fuse_linear_relu, which rewrite every block. Chromium comes from playwright (its own,
else ``--chromium PATH``).

    .venv/bin/python bench/report.py                       # every model
    .venv/bin/python bench/report.py --models resnet50_export --chromium /usr/bin/chromium
    .venv/bin/python bench/report.py --models stack_642 stack_2562 stack_10242
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
from fxopt.visualize import find_renderer, write_report
from playwright.sync_api import sync_playwright
from torch import nn

import fxopt
from fxopt.models import dropout_stack

RESNET_PASSES = ["fold_conv_bn", "cse", "dce", "inplace"]
STACK_PASSES = ["remove_dropout", "fuse_add_relu", "fuse_linear_relu"]
BERT_PASSES = ["remove_dropout", "eliminate_identity", "constant_fold", "cse", "dce", "inplace", "quantize"]


class Bottleneck(nn.Module):
    def __init__(self, inp: int, width: int, stride: int = 1):
        super().__init__()
        out = width * 4
        self.conv1, self.bn1 = nn.Conv2d(inp, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inp != out:
            self.downsample = nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
        self.relu, self.maxpool = nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
        inp, stages = 64, []
        for i, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
            stage = []
            for j in range(blocks):
                stage.append(Bottleneck(inp, width, 2 if i > 0 and j == 0 else 1))
                inp = width * 4
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(2048, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(capture: str):
    model, inputs = ResNet50().eval(), (torch.randn(1, 3, 224, 224),)
    source = torch.export.export(model, inputs) if capture == "export" else model
    return source, inputs, RESNET_PASSES


def bert(capture: str):
    from transformers import BertConfig, BertModel

    config = BertConfig(attn_implementation="eager")  # bert-base's shape, random weights
    model, inputs = BertModel(config).eval(), (torch.randint(0, config.vocab_size, (1, 128)),)
    return torch.export.export(model, inputs), inputs, BERT_PASSES


def stack(blocks: int):
    return dropout_stack(blocks), (torch.randn(2, 8),), STACK_PASSES


MODELS = {"resnet50_export": lambda: resnet50("export"), "resnet50_trace": lambda: resnet50("trace"),
          "bert_export": lambda: bert("export"),
          **{f"stack_{5 * b + 2}": (lambda b=b: stack(b)) for b in (128, 512, 2048)}}


def cpu_seconds() -> float:
    """CPU time of this process and of the renderers it ran: on a shared machine, what the
    report costs whatever the other processes take."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def diff_truth(gm) -> list[tuple[str, int, int]]:
    """(pass, nodes it erased, nodes it created) for each changing pass, from the graphs
    themselves (Node identity between consecutive snapshots; not ``users``, which the
    snapshots share with the later graphs)."""
    records = [r for _, r in fxopt.report_of(gm).walk() if r.before is not None]
    out = []
    for i, r in enumerate(records):
        after = records[i + 1].before.nodes if i + 1 < len(records) else list(gm.graph.nodes)
        before = list(r.before.nodes)
        erased = [n for n in before if n not in set(after)]
        created = [n for n in after if n not in set(before)]
        out.append((r.name, len(erased), len(created)))
    return out


def measure(name: str, browser, out: Path) -> None:
    source, inputs, passes = MODELS[name]()
    exported = isinstance(source, torch.export.ExportedProgram)
    model_state = source.state_dict if exported else source.state_dict()
    start = time.perf_counter()
    gm = fxopt.optimize(source, passes=passes, example_inputs=inputs)
    optimize_s = time.perf_counter() - start
    start, cpu = time.perf_counter(), cpu_seconds()
    path = write_report(gm, out / f"{name}.html")
    write_s, write_cpu = time.perf_counter() - start, cpu_seconds() - cpu
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
    start = time.perf_counter()
    page.goto(path.resolve().as_uri())
    page.wait_for_load_state("load")
    load_s = time.perf_counter() - start
    probe = list(gm.graph.nodes)[len(gm.graph.nodes) // 2].name
    start = time.perf_counter()
    hits = page.evaluate("q => fxReport.search(q)", probe)
    search_ms = (time.perf_counter() - start) * 1e3
    current = page.locator("g.node.fx-current text").first.text_content().strip() if hits else None
    drawn = page.evaluate("document.querySelectorAll('.fx-zoom g.node:not(.fx_legend)').length")
    diffs = page.evaluate("[...document.querySelectorAll('section.fx-pass')].filter(s => s.querySelector("
                          "'.fx-diff-summary')).map(s => !!s.querySelector('.fx-zoom svg'))")
    notes = page.eval_on_selector_all(".fx-collapsed-note, .fx-grouped-note", "els => els.map(e => e.textContent)")
    page.close()
    captured = next(r for _, r in fxopt.report_of(gm).walk()).nodes_before
    print(f"\n{name}: {captured} nodes captured, {len(gm.graph.nodes)} after {passes}")
    print(f"  optimize {optimize_s:.1f} s, write_report {write_s:.1f} s ({write_cpu:.1f} s CPU), "
          f"{path.stat().st_size / 1e6:.2f} MB, "
          f"load {load_s:.2f} s, {drawn} nodes drawn, diffs drawn {sum(diffs)} of {len(diffs)}, "
          f"JS errors {errors or 'none'}")
    print(f"  search {probe!r}: {hits} matches, current {current!r}, {search_ms:.0f} ms")
    dead = [n.name for n in gm.graph.nodes if n.op == "get_attr" and not n.users]
    print(f"  unused get_attr nodes in the result: {len(dead)}; parameters and buffers "
          f"{len(gm.state_dict())} (captured model: {len(model_state)})")
    for p, erased, created in diff_truth(gm):
        print(f"  {p}: erased {erased} nodes, created {created}")
    for note in notes:
        print(f"  {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--chromium", help="a Chromium binary (default: playwright's own)")
    parser.add_argument("--out", type=Path, help="keep the reports here (default: a temporary folder)")
    args = parser.parse_args()
    print(f"{platform.machine()} {platform.processor() or ''}, torch {torch.__version__}, "
          f"renderer {find_renderer()}")
    with sync_playwright() as p, tempfile.TemporaryDirectory() as tmp:
        browser = p.chromium.launch(executable_path=args.chromium)
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        for name in args.models:
            measure(name, browser, out)
        browser.close()


if __name__ == "__main__":
    main()
