"""The model zoo: small, hand-written motifs that rewrites meet in real models, plus the
full architectures of :mod:`fxopt.models`.

Each :class:`ZooCase` carries how to build its model (eval mode, seeded, BatchNorm with
random statistics so that a folding bug cannot hide behind mean 0 / variance 1), how to
draw its inputs, the dtypes it runs in, tags to select it by, and tolerance overrides
for dtypes where the motif is numerically touchy. ``case.instantiate(dtype)`` gives a
traced GraphModule with shapes recorded (``meta['val']``) and inputs to run it on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxopt import models
from fxopt.numerics import tolerance_for

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


# --- motifs ---------------------------------------------------------------------------


class ResidualConvBNReLU(nn.Module):
    """conv-BN-ReLU-conv-BN plus a (1x1 conv-BN) shortcut, then ReLU: ResNet's block."""

    def __init__(self, cin: int = 8, cout: int = 16):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + self.shortcut(x))


class Attention(nn.Module):
    """Multi-head self-attention written out: projections, scaled scores, softmax, mask."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5
        scores = scores - scores.amax(-1, keepdim=True)  # the usual stabilization
        scores = scores.masked_fill(mask == 0, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


def _attention_inputs(dtype: torch.dtype, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    x = torch.randn(2, 6, 32, generator=generator).to(dtype)
    return x, torch.tril(torch.ones(6, 6, dtype=torch.bool))


class MLP(nn.Module):
    """LayerNorm, Linear-GELU-Dropout-Linear, residual: the feed-forward half of a block."""

    def __init__(self, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(F.gelu(self.fc1(self.norm(x)))))


class ViewsAndInPlace(nn.Module):
    """Views, reshapes, slices and in-place updates on intermediates (never the input):
    the code that in-place-unaware rewrites get wrong."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(4, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = x * self.scale  # (4, 12)
        act = torch.relu(y)  # read before y is written through its views below
        v = y.view(4, 3, 4)
        v.add_(1.0)  # writes through the view into y
        t = v.permute(2, 0, 1).contiguous()
        t.relu_()
        z = t.reshape(-1, 6)
        z[:, 0].copy_(z[:, 1] * 2.0)
        before = y.sum()
        w = y.transpose(0, 1)[2:8]
        w.mul_(0.5)  # y changes again, after z was taken: y.sum() differs from `before`
        r = torch.flatten(z, 0)
        r += y.sum() - before
        return y, r.unsqueeze(0).expand(2, -1).clone(), act


class UNetBlock(nn.Module):
    """One U-Net level: encode, downsample, bottleneck, upsample, concat the skip, decode."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.mid = nn.Sequential(nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.dec = nn.Sequential(nn.Conv2d(3 * c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.enc(x)
        low = self.mid(F.max_pool2d(skip, 2))
        up = F.interpolate(low, scale_factor=2.0, mode="nearest")
        return self.dec(torch.cat([skip, self.up(low), up[:, : x.shape[1]]], dim=1))


class DenseBlock(nn.Module):
    """A DenseNet block: every layer reads the concatenation of all earlier outputs."""

    def __init__(self, c: int = 8, growth: int = 4, layers: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.BatchNorm2d(c + i * growth), nn.ReLU(),
                          nn.Conv2d(c + i * growth, growth, 3, padding=1, bias=False))
            for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(torch.cat(features, 1)))
        return torch.cat(features, 1)


class TransformerBlock(nn.Module):
    """A pre-norm transformer block: attention (SDPA) and MLP, each with a residual."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim)
        self.mlp = MLP(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self.out(attn.transpose(1, 2).flatten(2))
        return self.mlp(x)


class MultiHead(nn.Module):
    """A shared trunk with several heads returning a nested dict: structured outputs."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.cls = nn.Linear(dim, 5)
        self.box = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = self.trunk(x)
        logits = self.cls(h)
        return {"logits": logits, "aux": (torch.log_softmax(logits, -1), [self.box(h).sigmoid()])}


# --- cases ----------------------------------------------------------------------------


InputFactory = Callable[[torch.dtype, torch.Generator], tuple[Any, ...]]


def _randn(*shapes: tuple[int, ...]) -> InputFactory:
    def make(dtype: torch.dtype, generator: torch.Generator) -> tuple[Any, ...]:
        return tuple(torch.randn(s, generator=generator).to(dtype) for s in shapes)

    return make


@dataclass(frozen=True)
class ZooCase:
    """One model of the zoo: how to build it and its inputs, and how to judge it."""

    name: str
    build: Callable[[], nn.Module]
    make_inputs: InputFactory
    tags: frozenset[str] = frozenset()
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    #: (rtol, atol) per dtype where the defaults of fxopt.numerics are too tight
    tolerances: Mapping[torch.dtype, tuple[float, float]] = field(default_factory=dict)

    def tolerance(self, dtype: torch.dtype) -> tuple[float, float]:
        return self.tolerances.get(dtype) or tolerance_for(dtype)

    def model(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        return models.reseeded(self.build()).eval().to(dtype)

    def inputs(self, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[Any, ...]:
        return self.make_inputs(dtype, torch.Generator().manual_seed(seed))

    def instantiate(self, dtype: torch.dtype = torch.float32, seed: int = 0) -> CaseInstance:
        """The traced model in ``dtype`` with shapes recorded, and inputs for it."""
        from fxopt.optimize import optimize  # fxopt.optimize imports the registry, lazily

        if dtype not in self.dtypes:
            raise ValueError(f"zoo case {self.name!r} does not run in {dtype} (it runs in {self.dtypes})")
        inputs = self.inputs(dtype, seed)
        gm = fx.symbolic_trace(self.model(dtype))
        optimize(gm, passes=[], example_inputs=inputs, inplace=True)  # records meta['val']
        rtol, atol = self.tolerance(dtype)
        return CaseInstance(self, dtype, gm, inputs, rtol, atol)


@dataclass
class CaseInstance:
    """A zoo case built in one dtype: what the ``fx_case`` fixture hands a test."""

    case: ZooCase
    dtype: torch.dtype
    gm: fx.GraphModule
    inputs: tuple[Any, ...]
    rtol: float
    atol: float

    @property
    def name(self) -> str:
        return f"{self.case.name}-{str(self.dtype).removeprefix('torch.')}"

    @property
    def tags(self) -> frozenset[str]:
        return self.case.tags


def _arch(name: str, input_shape: tuple[int, ...], tags: Iterable[str], **kw: Any) -> ZooCase:
    factory = getattr(models, name)
    return ZooCase(name, factory, _randn(input_shape), frozenset({"arch", "large", *tags}), **kw)


#: every case, by name: hand-written motifs first, then full architectures
ZOO: dict[str, ZooCase] = {c.name: c for c in [
    ZooCase("residual_conv_bn_relu", ResidualConvBNReLU, _randn((2, 8, 12, 12)),
            frozenset({"conv", "bn", "residual", "relu"})),
    ZooCase("attention", Attention, _attention_inputs, frozenset({"attention", "matmul", "softmax", "view"})),
    ZooCase("mlp", MLP, _randn((4, 32)), frozenset({"mlp", "linear", "norm", "dropout"})),
    ZooCase("views_inplace", ViewsAndInPlace, _randn((4, 12)), frozenset({"view", "inplace"})),
    ZooCase("unet_block", UNetBlock, _randn((2, 8, 8, 8)), frozenset({"conv", "bn", "cat", "unet", "pool"})),
    ZooCase("densenet_block", DenseBlock, _randn((2, 8, 8, 8)), frozenset({"conv", "bn", "cat", "densenet"})),
    ZooCase("transformer_block", TransformerBlock, _randn((2, 6, 32)),
            frozenset({"attention", "transformer", "linear", "norm"})),
    ZooCase("multi_head", MultiHead, _randn((3, 16)), frozenset({"linear", "nested"})),
    ZooCase("demo", models.DemoNet, _randn((2, 3, 16, 16)),  # casts with .float(): fp32 only
            frozenset({"conv", "bn", "dropout", "residual"}), dtypes=(torch.float32,)),
    _arch("resnet18", (1, 3, 64, 64), {"conv", "bn", "residual"}),
    _arch("mobilenet_v2", (1, 3, 64, 64), {"conv", "bn", "depthwise"}),
    _arch("transformer_encoder", (1, 16, 256), {"attention", "transformer"}),
    _arch("unet", (1, 3, 32, 32), {"conv", "bn", "cat", "unet"}),
    _arch("densenet", (1, 3, 32, 32), {"conv", "bn", "cat", "densenet"}),
]}


def select(tags: Iterable[str] = (), exclude: Iterable[str] = (),
           names: Iterable[str] = ()) -> list[ZooCase]:
    """Cases having any of ``tags`` (all if empty), none of ``exclude``, named in ``names``."""
    tags, exclude, names = set(tags), set(exclude), set(names)
    unknown = names - set(ZOO)
    if unknown:
        raise KeyError(f"unknown zoo case(s) {sorted(unknown)}; known: {sorted(ZOO)}")
    return [c for c in ZOO.values()
            if (not tags or c.tags & tags) and not c.tags & exclude and (not names or c.name in names)]
