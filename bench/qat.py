"""Float vs post-training quantization vs quantization-aware training on scikit-learn's
digits, side by side in one run, with PyTorch's own QAT flow (torchao's
``prepare_qat_pt2e`` + ``XNNPACKQuantizer``; torch 2.13 no longer ships
``torch.ao.quantization.quantize_pt2e``) on the same model and schedule where it runs.

    pip install scikit-learn torchao
    python bench/qat.py --seeds 0 1 2                # the record: bench/results/cpu/qat.json
    python bench/qat.py --smoke                      # synthetic 8x8 images, one seed, seconds (CI)

Per seed: train the float CNN of ``examples/qat_digits.py``; quantize it after training
(BatchNorm folded, int8 weights + activations static, calibrated on 512 training images;
int4 weights, group 128); fine-tune copies of the float model with fxopt QAT (int8 static,
int4 weight-only) and with pt2e QAT (int8 static) for ``--qat-epochs`` epochs, observers
and BatchNorm frozen for the last epoch (pt2e: observers only; it has no BatchNorm freeze
for exported graphs); convert and measure test accuracy and test cross-entropy. One record
row per seed; where torchao does not import, its column is missing and ``pt2e`` says why.
``--smoke`` runs every step on synthetic images (ten noisy 8x8 prototypes: scikit-learn is
not a test dependency) for an epoch or two.
"""

from __future__ import annotations

import copy
import importlib.util
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from harness import Record, cli, cpu_threads, markdown_table

import fxopt
import fxopt.quant as fq

_spec = importlib.util.spec_from_file_location(
    "qat_digits", Path(__file__).resolve().parent.parent / "examples" / "qat_digits.py")
digits_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(digits_example)


@torch.no_grad()
def evaluate(model, x, y) -> dict[str, float]:
    logits = model(x)
    return {"acc": (logits.argmax(-1) == y).float().mean().item() * 100,
            "nll": F.cross_entropy(logits, y).item()}


def pt2e_qat(model, x_train, y_train, example, epochs, freeze_after, lr, seed):
    """PyTorch's QAT on the same model and schedule; None (and why) if it cannot run."""
    try:
        from torchao.quantization.pt2e import (
            disable_observer,
            move_exported_model_to_eval,
            move_exported_model_to_train,
        )
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_qat_pt2e
        from torchao.testing.pt2e._xnnpack_quantizer import (
            XNNPACKQuantizer,
            get_symmetric_quantization_config,
        )
    except ImportError as exc:
        return None, f"torchao not importable: {exc}"
    quantizer = XNNPACKQuantizer().set_global(
        get_symmetric_quantization_config(is_per_channel=True, is_qat=True))
    batch = {0: torch.export.Dim("batch", min=2)}
    exported = torch.export.export(model.train(), example, dynamic_shapes=(batch,))
    prepared = prepare_qat_pt2e(exported.module(), quantizer)
    generator = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(prepared.parameters(), lr=lr)
    steps = epochs * ((len(x_train) + 63) // 64)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    move_exported_model_to_train(prepared)
    step = 0
    for _ in range(epochs):
        for xb, yb in digits_example.batches(x_train, y_train, 64, generator):
            if step == freeze_after:
                prepared.apply(disable_observer)
            loss = F.cross_entropy(prepared(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
    converted = convert_pt2e(prepared)
    move_exported_model_to_eval(converted)
    return converted, "torchao prepare_qat_pt2e + XNNPACKQuantizer (per-channel symmetric weights, is_qat)"


def synthetic_digits(seed: int) -> tuple[torch.Tensor, ...]:
    """``--smoke``'s stand-in for scikit-learn's digits: ten 8x8 prototypes in [0, 1] plus
    noise, 160 training and 40 test images (a split as ``digits`` returns it)."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.rand(10, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (200,), generator=g)
    x = (prototypes[y] + 0.3 * torch.randn(200, 1, 8, 8, generator=g)).clamp(0, 1)
    return x[:160], y[:160], x[160:], y[160:]


def run_seed(seed: int, float_epochs: int, qat_epochs: int, smoke: bool) -> dict[str, Any]:
    """One seed's row: every model's test accuracy and cross-entropy, and the seconds of each step."""
    torch.manual_seed(seed)
    x_train, y_train, x_test, y_test = (synthetic_digits if smoke else digits_example.digits)(seed)
    example = (x_train[:64],)
    start = time.perf_counter()
    model = digits_example.train(digits_example.DigitsCNN(), x_train, y_train, float_epochs, 3e-3,
                                 f"float s{seed}", seed)
    row = {"float": evaluate(model, x_test, y_test)}
    folded = fxopt.optimize(model.eval(), ["fold_conv_bn"], example_inputs=example)
    calibration = [(x_train[i:i + 64],) for i in range(0, min(512, len(x_train)), 64)]
    row["ptq int8"] = evaluate(fq.quantize_model(folded, example, "int8_static",
                                                 calibration_data=calibration), x_test, y_test)
    row["ptq int4"] = evaluate(fq.quantize_model(folded, example, "int4_weight_only",
                                                 group_size=digits_example.INT4_GROUP), x_test, y_test)
    steps_per_epoch = (len(x_train) + 63) // 64
    freeze = steps_per_epoch * (qat_epochs - 1)
    timings = {"float": time.perf_counter() - start}
    for mode, key, options in (("int8_static", "qat int8", {}),
                               ("int4_weight_only", "qat int4", {"group_size": digits_example.INT4_GROUP})):
        t = time.perf_counter()
        qat = fq.prepare_qat(copy.deepcopy(model).train(), example, mode, freeze_bn_after=freeze,
                             freeze_observers_after=freeze, **options)
        digits_example.train(qat, x_train, y_train, qat_epochs, 3e-4, f"{key} s{seed}", seed)
        row[key] = evaluate(fq.convert_qat(qat), x_test, y_test)
        timings[key] = time.perf_counter() - t
    t = time.perf_counter()
    converted, what = pt2e_qat(copy.deepcopy(model), x_train, y_train, example, qat_epochs, freeze, 3e-4, seed)
    if converted is not None:
        row["pt2e qat int8"] = evaluate(converted, x_test, y_test)
        timings["pt2e qat int8"] = time.perf_counter() - t
    return {"seed": seed, "results": row, "seconds": timings, "pt2e": what}


def summary(rows: list[dict[str, Any]]) -> str:
    """Accuracy (cross-entropy) per seed and model, and the mean accuracy of each model."""
    names = list(rows[0]["results"])
    lines = [{"seed": r["seed"], **{n: f"{r['results'][n]['acc']:.2f} ({r['results'][n]['nll']:.3f})" for n in names}}
             for r in rows]
    lines.append({"seed": "mean", **{n: f"{sum(r['results'][n]['acc'] for r in rows) / len(rows):.2f}" for n in names}})
    return markdown_table(lines, ["seed", *names])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--float-epochs", type=int, default=15)
    parser.add_argument("--qat-epochs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny model: 1 is fastest)")
    args = parser.parse_args(argv)
    seeds, float_epochs, qat_epochs = ([0], 1, 2) if args.smoke else (args.seeds, args.float_epochs, args.qat_epochs)
    record = Record("qat", args, cli.device_for(args, default="cpu"))
    with cpu_threads(args.threads):
        for seed in seeds:
            record.add(run_seed(seed, float_epochs, qat_epochs, args.smoke))
    print(summary(record.rows))
    print(f"pt2e: {record.rows[0]['pt2e']}")
    print("per seed: " + ", ".join(f"{k} {v:.1f} s" for k, v in record.rows[0]["seconds"].items()))
    return record.data


if __name__ == "__main__":
    main()
