"""The HTML report on real models: its size, how long it takes to write and to load in
headless Chromium, a search, and whether the diffs hold only the real change.

Models: ResNet-50 (torchvision's layout, written out below: torchvision is not a
dependency) captured by ``torch.export`` and by ``symbolic_trace``, and BERT-base
(``transformers``' ``BertModel`` with random weights, sequence 128) when transformers is
installed. The ``stack_*`` models measure how the report scales (issue 39): 128, 512 and
2,048 small blocks (linear, ReLU, dropout, residual add, ReLU; 642, 2,562 and 10,242
nodes), ``symbolic_trace``, optimized with remove_dropout, fuse_add_relu and
fuse_linear_relu, which rewrite every block. Chromium comes from playwright (its own,
else ``--chromium PATH``, else a Chromium on the PATH). Times are the harness's ``clocked``:
wall seconds, and for ``write_report`` the CPU seconds too, the Graphviz renderers it runs
included. One row per model; a model that fails is a row saying why.

    .venv/bin/python bench/report.py                       # every model
    .venv/bin/python bench/report.py --models resnet50_export --chromium /usr/bin/chromium
    .venv/bin/python bench/report.py --models stack_642 stack_2562 stack_10242
    .venv/bin/python bench/report.py --smoke               # a 42-node stack (CI)
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from fxopt.visualize import find_renderer, write_report
from harness import Record, cli, clocked
from playwright.sync_api import Browser, Error, Playwright, sync_playwright
from torch import nn

import fxopt
from fxopt.models import dropout_stack

RESNET_PASSES = ["fold_conv_bn", "cse", "dce", "inplace"]
STACK_PASSES = ["remove_dropout", "fuse_add_relu", "fuse_linear_relu"]
BERT_PASSES = ["remove_dropout", "eliminate_identity", "constant_fold", "cse", "dce", "inplace", "quantize"]
#: system Chromium binaries, where playwright has no browser of its own
CHROMIUMS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


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
          **{f"stack_{5 * b + 2}": (lambda b=b: stack(b)) for b in (8, 128, 512, 2048)}}
#: ``--smoke``: 8 blocks, 42 nodes; not among the default models
SMOKE_MODEL = "stack_42"


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


def in_browser(browser: Browser, path: Path, gm: torch.fx.GraphModule) -> dict[str, Any]:
    """The page loaded in ``browser``: load time, a search for a node in the middle of the
    graph, what is drawn, and every JavaScript error or warning."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
    loaded = clocked(lambda: (page.goto(path.resolve().as_uri()), page.wait_for_load_state("load")))
    probe = list(gm.graph.nodes)[len(gm.graph.nodes) // 2].name
    searched = clocked(lambda: page.evaluate("q => fxReport.search(q)", probe))
    current = page.locator("g.node.fx-current text").first.text_content().strip() if searched.value else None
    drawn = page.evaluate("document.querySelectorAll('.fx-zoom g.node:not(.fx_legend)').length")
    diffs = page.evaluate("[...document.querySelectorAll('section.fx-pass')].filter(s => s.querySelector("
                          "'.fx-diff-summary')).map(s => !!s.querySelector('.fx-zoom svg'))")
    notes = page.eval_on_selector_all(".fx-collapsed-note, .fx-grouped-note", "els => els.map(e => e.textContent)")
    page.close()
    return {"load_s": loaded.wall_s, "search": probe, "search_hits": searched.value, "search_current": current,
            "search_ms": searched.wall_s * 1e3, "nodes_drawn": drawn, "diffs": len(diffs), "diffs_drawn": sum(diffs),
            "js_errors": errors, "notes": notes}


def measure(name: str, browser: Browser, folder: Path) -> dict[str, Any]:
    """Optimize model ``name``, write its report into ``folder`` and use it in ``browser``."""
    source, inputs, passes = MODELS[name]()
    exported = isinstance(source, torch.export.ExportedProgram)
    model_state = source.state_dict if exported else source.state_dict()
    optimized = clocked(lambda: fxopt.optimize(source, passes=passes, example_inputs=inputs))
    gm = optimized.value
    written = clocked(lambda: write_report(gm, folder / f"{name}.html"))
    return {"model": name, "passes": passes, "nodes_captured": next(r for _, r in fxopt.report_of(gm).walk()).nodes_before,
            "nodes_after": len(gm.graph.nodes), "optimize_s": optimized.wall_s, "write_s": written.wall_s,
            "write_cpu_s": written.cpu_s, "size_MB": written.value.stat().st_size / 1e6,
            **in_browser(browser, written.value, gm),
            "unused_get_attr": sum(n.op == "get_attr" and not n.users for n in gm.graph.nodes),
            "state_tensors": len(gm.state_dict()), "captured_state_tensors": len(model_state),
            "diff_truth": [{"pass": p, "erased": erased, "created": created} for p, erased, created in diff_truth(gm)]}


def describe(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"\n{row['model']}: {row['error']}"
    lines = [f"\n{row['model']}: {row['nodes_captured']} nodes captured, {row['nodes_after']} after {row['passes']}",
             f"  optimize {row['optimize_s']:.1f} s, write_report {row['write_s']:.1f} s ({row['write_cpu_s']:.1f} s CPU), "
             f"{row['size_MB']:.2f} MB, load {row['load_s']:.2f} s, {row['nodes_drawn']} nodes drawn, diffs drawn "
             f"{row['diffs_drawn']} of {row['diffs']}, JS errors {row['js_errors'] or 'none'}",
             f"  search {row['search']!r}: {row['search_hits']} matches, current {row['search_current']!r}, "
             f"{row['search_ms']:.0f} ms",
             f"  unused get_attr nodes in the result: {row['unused_get_attr']}; parameters and buffers "
             f"{row['state_tensors']} (captured model: {row['captured_state_tensors']})"]
    lines += [f"  {d['pass']}: erased {d['erased']} nodes, created {d['created']}" for d in row["diff_truth"]]
    return "\n".join(lines + [f"  {note}" for note in row["notes"]])


@contextlib.contextmanager
def chromium(executable: str | None) -> Iterator[Browser]:
    """A headless Chromium through playwright: ``executable``, else playwright's own, else
    one on the PATH (as the visualize tests find theirs)."""
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable) if executable else _any_chromium(p)
        try:
            yield browser
        finally:
            browser.close()


def _any_chromium(p: Playwright) -> Browser:
    try:
        return p.chromium.launch()
    except Error as exc:
        system = next(filter(None, map(shutil.which, CHROMIUMS)), None)
        if system is None:
            raise SystemExit("no Chromium: run `playwright install chromium`, or pass --chromium PATH") from exc
        return p.chromium.launch(executable_path=system)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=[m for m in MODELS if m != SMOKE_MODEL], choices=list(MODELS))
    parser.add_argument("--chromium", help="a Chromium binary (default: playwright's own, else one on the PATH)")
    parser.add_argument("--keep", type=Path, help="keep the reports in this folder (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models = [SMOKE_MODEL]
    record = Record("report", args, "cpu", renderer=find_renderer())
    print(f"{record.meta['cpu']}, torch {record.meta['torch']}, renderer {record.meta['renderer']}")
    with chromium(args.chromium) as browser, tempfile.TemporaryDirectory() as tmp:
        record.meta["chromium"] = browser.version
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for name in args.models:
            try:
                row = measure(name, browser, folder)
            except Exception as exc:  # one model that fails (transformers missing) must not lose the others
                row = {"model": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(describe(record.add(row)), flush=True)
    return record.data


if __name__ == "__main__":
    main()
