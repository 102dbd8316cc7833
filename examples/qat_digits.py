"""Quantization-aware training on scikit-learn's digits (offline: the data ships inside
scikit-learn): a small CNN trained in float, quantized after training (int8 weights and
activations; int4 weights), then fine-tuned with fxopt's QAT and converted to the same
int8/int4 lowering. Runs on CPU in well under two minutes.

    pip install scikit-learn && python examples/qat_digits.py
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

import fxopt
import fxopt.quant as fq

INT4_GROUP = 128  # int4 weights: one scale per 128 values along K


class DigitsCNN(nn.Module):
    """Two conv + BatchNorm + ReLU blocks and a two-layer head, for 8x8 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.fc1, self.fc2 = nn.Linear(32 * 4 * 4, 128), nn.Linear(128, 10)
        self.dropout = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc2(self.dropout(F.relu(self.fc1(x.flatten(1)))))


def digits(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_test, y_test): 1437 / 360 images scaled to [0, 1], a fixed split."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    train, test = order[:1437], order[1437:]
    return x[train], y[train], x[test], y[test]


def batches(x: torch.Tensor, y: torch.Tensor, size: int, generator: torch.Generator):
    order = torch.randperm(len(x), generator=generator)
    for i in range(0, len(x), size):
        yield x[order[i:i + size]], y[order[i:i + size]]


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float,
          desc: str, seed: int = 0) -> nn.Module:
    """Adam with cosine decay, batch 64; a tqdm bar over the steps."""
    generator = torch.Generator().manual_seed(seed)
    steps = epochs * ((len(x) + 63) // 64)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    model.train()
    with tqdm(total=steps, desc=desc, unit="step") as bar:
        for _ in range(epochs):
            for xb, yb in batches(x, y, 64, generator):
                loss = F.cross_entropy(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                bar.set_postfix(loss=f"{loss.item():.3f}")
                bar.update()
    return model.eval()


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy in percent."""
    return (model(x).argmax(-1) == y).float().mean().item() * 100


def run(float_epochs: int = 15, qat_epochs: int = 3, seed: int = 0) -> dict[str, float]:
    torch.manual_seed(seed)
    x_train, y_train, x_test, y_test = digits(seed)
    example = (x_train[:64],)
    model = train(DigitsCNN(), x_train, y_train, float_epochs, 3e-3, "float", seed)
    results = {"float": accuracy(model, x_test, y_test)}

    # post-training: BatchNorm folded into the convs, then quantized
    folded = fxopt.optimize(model.eval(), ["fold_conv_bn"], example_inputs=example)
    calibration = [(x_train[i:i + 64],) for i in range(0, 512, 64)]
    ptq8 = fq.quantize_model(folded, example, "int8_static", calibration_data=calibration)
    ptq4 = fq.quantize_model(folded, example, "int4_weight_only", group_size=INT4_GROUP)
    results["ptq int8"] = accuracy(ptq8, x_test, y_test)
    results["ptq int4"] = accuracy(ptq4, x_test, y_test)

    # quantization-aware fine-tuning of the float model, then the same lowering
    steps_per_epoch = (len(x_train) + 63) // 64
    for mode, key, options in (("int8_static", "qat int8", {}),
                               ("int4_weight_only", "qat int4", {"group_size": INT4_GROUP})):
        qat = fq.prepare_qat(copy.deepcopy(model).train(), example, mode,
                             freeze_bn_after=steps_per_epoch * (qat_epochs - 1),
                             freeze_observers_after=steps_per_epoch * (qat_epochs - 1), **options)
        train(qat, x_train, y_train, qat_epochs, 3e-4, key, seed)
        results[key] = accuracy(fq.convert_qat(qat), x_test, y_test)
    return results


def main() -> None:
    torch.set_num_threads(1)  # a tiny model: per-op overhead dominates, more threads only contend
    start = time.perf_counter()
    results = run()
    for name, value in results.items():
        print(f"{name:>9}: {value:6.2f} %")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
