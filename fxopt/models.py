"""Small models that ship with fxopt: the demo's model and handy test subjects."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class DemoNet(nn.Module):
    """A small residual conv net with the things fxopt's default pipeline cleans up:
    dropout, an identity, duplicated computations, a constant subexpression over weights,
    a no-op cast and dead code."""

    def __init__(self, channels: int = 16, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.block = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
        )
        self.identity = nn.Identity()
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(channels, classes)
        self.class_scale = nn.Parameter(torch.randn(classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stem(x)))
        y = self.identity(self.block(x))
        x = torch.relu(y + x)
        unused = x.sum(dim=1)  # dead code  # noqa: F841
        pooled = x.mean(dim=(2, 3)).float()  # a no-op cast
        shift = x.mean(dim=(2, 3))  # computed twice: CSE merges it
        scale = torch.sigmoid(self.class_scale) * 2.0  # depends only on a parameter: folded
        return self.head(self.drop(pooled)) * scale + self.head(shift)


def demo_model() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The demo model in eval mode with random BN statistics, and an example input."""
    torch.manual_seed(0)
    model = DemoNet().eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
    return model, (torch.randn(2, 3, 32, 32),)
