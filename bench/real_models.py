"""Real-model sweep: fxopt's pipelines on torchvision, timm and transformers models over
every capture path, recording ok / typed error / wrong result / crash per run.

Not a test (CI does not install these libraries): a benchmark of trust. For each model
that builds here (random weights, small inputs, no downloads) and each capture path
(``symbolic_trace``, ``torch.export``, ``make_fx``, Dynamo's graph handed to a backend)
and each pipeline (the default pipeline, the fusions, ``inplace``), it optimizes the
captured graph, runs it and eager on the same fresh random inputs, and compares outputs
and the model's buffers afterwards (running statistics in training mode). Outcomes:

- ``ok``: same outputs and buffers within tolerance;
- ``typed``: fxopt refused with an ``FxoptError`` (its class and message are recorded);
- ``capture``: torch could not capture the model on that path (not fxopt's doing);
- ``wrong``: different outputs or buffers (the worst outcome: a silent wrong result);
- ``crash``: any other exception from fxopt or from the optimized program.

Usage::

    python bench/real_models.py [--models resnet18,bert] [--paths symbolic_trace,export]
                                [--json bench/results/cpu/real_models.json] [--train]
    python bench/real_models.py --smoke     # fxopt's demo net, two capture paths (CI)

The record (``--out``, or its old name ``--json``) defaults to ``bench/results/<gpu>/real_models.json``;
the exit status is 1 when any run was wrong or crashed.

The torchvision wheel on PyPI is built for CUDA; on a CPU-only torch its C extension
(detection ops) does not load. The models used here need none of those ops, so the
import below skips their registration instead of failing.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from harness import Record, cli
from tqdm import tqdm

import fxopt

PIPELINES: dict[str, list[str]] = {
    "default": list(fxopt.DEFAULT_PIPELINE),
    "fusions": ["fold_conv_bn", "fuse_conv_bn_relu", "fuse_add_relu", "fuse_linear_relu"],
    "inplace": ["inplace"],
}
PATHS = ("symbolic_trace", "export", "make_fx", "dynamo")


@contextlib.contextmanager
def _tolerant_torchvision_import():
    """Import torchvision with a CUDA-built C extension on a CPU torch (see the docstring)."""
    original = torch.library.register_fake

    def register_fake(*args: Any, **kwargs: Any) -> Any:
        decorator = original(*args, **kwargs)

        def apply(fn: Any) -> Any:
            try:
                return decorator(fn)
            except RuntimeError:
                return fn
        return apply

    torch.library.register_fake = register_fake
    try:
        yield
    finally:
        torch.library.register_fake = original


def _torchvision(name: str, **kwargs: Any) -> Callable[[], tuple[nn.Module, tuple]]:
    def make() -> tuple[nn.Module, tuple]:
        with _tolerant_torchvision_import():
            import torchvision.models as tvm
        size = kwargs.pop("size", 64)
        return getattr(tvm, name)(weights=None, **kwargs), (torch.randn(2, 3, size, size),)
    return make


def _timm(name: str, size: int = 64, **kwargs: Any) -> Callable[[], tuple[nn.Module, tuple]]:
    def make() -> tuple[nn.Module, tuple]:
        with _tolerant_torchvision_import():
            import timm
        model = timm.create_model(name, pretrained=False, **kwargs)
        return model, (torch.randn(2, 3, size, size),)
    return make


def _hf(config_name: str, model_name: str, **config: Any) -> Callable[[], tuple[nn.Module, tuple]]:
    def make() -> tuple[nn.Module, tuple]:
        with _tolerant_torchvision_import():
            import transformers
        cfg = getattr(transformers, config_name)(**config)
        model = getattr(transformers, model_name)(cfg)
        model.config.use_cache = False
        if hasattr(model.config, "return_dict"):
            model.config.return_dict = False
        ids = torch.randint(0, cfg.vocab_size, (2, 16))
        if model_name.startswith("T5"):
            return _Seq2Seq(model), (ids, torch.randint(0, cfg.vocab_size, (2, 8)))
        return _LastHidden(model), (ids,)
    return make


class _HFWrapper(nn.Module):
    """A transformers model returning its first output tensor (HF models return tuples or
    dataclasses); ``dummy_inputs`` names the inputs for HF's tracer."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def dummy_inputs(self, inputs: tuple) -> dict[str, torch.Tensor]:
        names = list(inspect.signature(self.forward).parameters)
        return dict(zip(names, inputs))


class _LastHidden(_HFWrapper):

    def forward(self, input_ids):
        out = self.model(input_ids=input_ids)
        return out[0]


class _Seq2Seq(_HFWrapper):
    def forward(self, input_ids, decoder_input_ids):
        return self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids)[0]


_TINY_TEXT = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "intermediate_size": 128}
MODELS: dict[str, Callable[[], tuple[nn.Module, tuple]]] = {
    "resnet18": _torchvision("resnet18"),
    "resnet50": _torchvision("resnet50"),
    "mobilenet_v3_small": _torchvision("mobilenet_v3_small"),
    "efficientnet_b0": _torchvision("efficientnet_b0"),
    "convnext_tiny": _torchvision("convnext_tiny"),
    "regnet_y_400mf": _torchvision("regnet_y_400mf"),
    "densenet121": _torchvision("densenet121"),
    "shufflenet_v2_x0_5": _torchvision("shufflenet_v2_x0_5"),
    "squeezenet1_1": _torchvision("squeezenet1_1"),
    "swin_t": _torchvision("swin_t"),
    "vit_b_16": _torchvision("vit_b_16", image_size=64, size=64),
    "timm_resnet26d": _timm("resnet26d"),
    "timm_efficientnet_b0": _timm("efficientnet_b0"),
    "timm_convnext_atto": _timm("convnext_atto"),
    "timm_mobilenetv3_small_050": _timm("mobilenetv3_small_050"),
    "timm_regnety_002": _timm("regnety_002"),
    "timm_vit_tiny": _timm("vit_tiny_patch16_224", size=64, img_size=64),
    "bert": _hf("BertConfig", "BertModel", **_TINY_TEXT),
    "gpt2": _hf("GPT2Config", "GPT2Model", vocab_size=512, n_embd=64, n_layer=2, n_head=4),
    "llama": _hf("LlamaConfig", "LlamaModel", num_key_value_heads=2, **_TINY_TEXT),
    "t5": _hf("T5Config", "T5Model", vocab_size=512, d_model=64, d_kv=16, d_ff=128,
              num_layers=2, num_heads=4),
}
#: ``--smoke``: a model that needs no library beyond fxopt, over two capture paths
SMOKE = {"models": "fxopt_demo", "paths": "symbolic_trace,dynamo"}


def _fxopt_demo() -> tuple[nn.Module, tuple]:
    from fxopt.models import demo_model

    return demo_model()


MODELS["fxopt_demo"] = _fxopt_demo


# --- capture ------------------------------------------------------------------------------


def capture(path: str, model: nn.Module, inputs: tuple) -> tuple[fx.GraphModule, tuple]:
    """The GraphModule a user gets on ``path`` and the inputs it takes."""
    if path == "symbolic_trace":
        if isinstance(model, _HFWrapper) and importlib.util.find_spec("transformers.utils.fx"):
            from transformers.utils.fx import HFTracer  # HF's own tracer (gone in transformers 5)

            graph = HFTracer().trace(model, dummy_inputs=model.dummy_inputs(inputs))
            return fx.GraphModule(model, graph), inputs
        return fx.symbolic_trace(model), inputs
    if path == "export":
        return torch.export.export(model, inputs).module(), inputs
    if path == "make_fx":
        from torch.fx.experimental.proxy_tensor import make_fx

        return make_fx(model, tracing_mode="real")(*inputs), inputs
    if path == "dynamo":
        graphs: list[tuple[fx.GraphModule, tuple]] = []

        def grab(gm: fx.GraphModule, example_inputs: list) -> Callable:
            # Dynamo lifts parameters and buffers to inputs in some versions: the backend's
            # example inputs are exactly what the graph takes.
            graphs.append((gm, tuple(example_inputs)))
            return gm.forward

        torch._dynamo.reset()
        torch.compile(model, backend=grab, fullgraph=True)(*inputs)
        return graphs[0]
    raise ValueError(path)


# --- one run --------------------------------------------------------------------------------


def compare(a: Any, b: Any) -> float:
    """Largest error of ``b`` against ``a``, relative to ``a``'s scale (inf on mismatch)."""
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    if len(la) != len(lb):
        return float("inf")
    worst = 0.0
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                return float("inf")
            if x.is_floating_point():
                scale = x.abs().max().item() + 1e-6 if x.numel() else 1.0
                worst = max(worst, ((x - y).abs().max().item() / scale) if x.numel() else 0.0)
            elif not torch.equal(x, y):
                return float("inf")
    return worst


def run_one(name: str, path: str, pipeline: str, train: bool) -> dict[str, Any]:
    record: dict[str, Any] = {"model": name, "path": path, "pipeline": pipeline,
                              "mode": "train" if train else "eval"}
    model, inputs = MODELS[name]()
    model.train(train)
    torch.manual_seed(0)
    try:
        gm, call_inputs = capture(path, copy.deepcopy(model), inputs)
    except Exception as exc:  # torch could not capture: not fxopt's outcome
        record.update(outcome="capture", error=f"{type(exc).__name__}: {str(exc)[:200]}")
        return record
    start = time.perf_counter()
    try:
        opt = fxopt.optimize(gm, passes=PIPELINES[pipeline], example_inputs=call_inputs)
    except fxopt.FxoptError as exc:
        record.update(outcome="typed", error=f"{type(exc).__name__}: {str(exc)[:300]}")
        return record
    except Exception as exc:
        record.update(outcome="crash", error=f"{type(exc).__name__}: {str(exc)[:300]}",
                      trace=traceback.format_exc()[-1500:])
        return record
    record["optimize_s"] = round(time.perf_counter() - start, 3)
    record["nodes"] = [len(gm.graph.nodes), len(opt.graph.nodes)]
    reference, candidate = copy.deepcopy(gm), copy.deepcopy(opt)
    try:
        results = []
        for program in (reference, candidate):
            torch.manual_seed(1)
            with torch.no_grad():
                out = program(*[t.clone() if isinstance(t, torch.Tensor) else t for t in call_inputs])
            results.append((out, {k: v.clone() for k, v in program.named_buffers()}))
    except Exception as exc:
        record.update(outcome="crash", error=f"optimized program raised {type(exc).__name__}: "
                      f"{str(exc)[:300]}", trace=traceback.format_exc()[-1500:])
        return record
    (out_ref, buf_ref), (out_opt, buf_opt) = results
    error = compare(out_ref, out_opt)
    buffers = max((compare(v, buf_opt[k]) for k, v in buf_ref.items() if k in buf_opt), default=0.0)
    record["max_rel_error"] = error
    record["buffer_error"] = buffers
    record["outcome"] = "ok" if error <= 1e-3 and buffers <= 1e-3 else "wrong"
    return record


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(m for m in MODELS if m != "fxopt_demo"))
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--pipelines", default=",".join(PIPELINES))
    parser.add_argument("--train", action="store_true", help="also run each model in training mode")
    parser.add_argument("--json", dest="out", help="the old name of --out")
    args = parser.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    record = Record("real_models", args, "cpu")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        sweep(args, record)
    counts: dict[str, int] = {}
    for r in record.rows:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    record.extra["outcomes"] = counts
    record.save()
    print("outcomes:", counts)
    return record.data


def preload_torchvision() -> None:
    """Import torchvision where it is installed, before timm and transformers import it
    lazily, past the C extension a CPU torch cannot load (see the module's docstring)."""
    if importlib.util.find_spec("torchvision"):
        with _tolerant_torchvision_import():
            import torchvision  # noqa: F401


def sweep(args: Any, record: Record) -> None:
    """Every (model, path, pipeline, mode) run, each a row of ``record``."""
    preload_torchvision()
    runs = [(m, p, q, t) for m in args.models.split(",") for p in args.paths.split(",")
            for q in args.pipelines.split(",") for t in ((False, True) if args.train else (False,))]
    for m, p, q, t in tqdm(runs, desc="real models", file=sys.stderr):
        try:
            r = run_one(m, p, q, t)
        except Exception as exc:  # the model itself failed to build or run eagerly
            r = {"model": m, "path": p, "pipeline": q, "mode": "train" if t else "eval",
                 "outcome": "model", "error": f"{type(exc).__name__}: {str(exc)[:200]}",
                 "trace": traceback.format_exc()[-3000:]}
        record.add(r)
        print(f"{m:28} {p:15} {q:8} {r['mode']:5} {r['outcome']:8} {r.get('error', '')[:90]}",
              flush=True)


if __name__ == "__main__":
    outcomes = main()["outcomes"]
    sys.exit(1 if outcomes.get("wrong") or outcomes.get("crash") else 0)
