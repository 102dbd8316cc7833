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
    return reseeded(DemoNet()).eval(), (torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)),)


# --------------------------------------------------------------------------------------
# The zoo: full architectures written out by hand (torchvision is not a dependency), so
# they trace with ``torch.fx.symbolic_trace`` into ordinary torch-level graphs. Each
# factory returns a randomly initialized model in eval mode; ``example_inputs(name)``
# gives a batch-1 input for it. Activations are written out-of-place on purpose: turning
# them in-place is the ``inplace`` pass's job.
# --------------------------------------------------------------------------------------


def reseeded(model: nn.Module, seed: int = 0) -> nn.Module:
    """``model`` with weights that depend on ``seed`` alone, drawn from a generator of its own.

    Why not ``torch.manual_seed``: torch's global generator is process-wide; seeding it
    would change what every other thread, and the caller's next draw, gets. Modules drew
    their first weights from it when built; here every floating parameter is drawn again:
    a weight of two or more dimensions (and its module's biases) as ``nn.Linear`` and
    ``nn.Conv*`` draw theirs (uniform within 1/sqrt(fan_in)), any other parameter from a
    standard normal; then the norm layers get random statistics and affine parameters
    (:func:`randomize_norms`)."""
    generator = torch.Generator().manual_seed(seed)
    norms = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, norms):
                continue
            own = dict(module.named_parameters(recurse=False))
            weights = [p for p in own.values() if p.dim() >= 2]
            bound = weights[0][0].numel() ** -0.5 if weights else None
            for name, p in own.items():
                if p.dim() >= 2:
                    p.copy_((torch.rand(p.shape, generator=generator) * 2 - 1) * p[0].numel() ** -0.5)
                elif bound is not None and name.endswith("bias"):
                    p.copy_((torch.rand(p.shape, generator=generator) * 2 - 1) * bound)
                else:
                    p.copy_(torch.randn(p.shape, generator=generator))
    return randomize_norms(model, seed)


def randomize_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm random running statistics, and every norm layer random affine
    parameters: at their defaults (mean 0, variance 1, weight 1, bias 0) a rewrite that
    drops them, or folds them wrongly, would compute the same numbers."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.running_mean is not None:
                m.running_mean.copy_(torch.rand(m.running_mean.shape, generator=generator) - 0.5)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=generator) * 1.5 + 0.5)
            if isinstance(m, (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)):
                if getattr(m, "weight", None) is not None:
                    m.weight.copy_(torch.rand(m.weight.shape, generator=generator) + 0.5)
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(torch.rand(m.bias.shape, generator=generator) * 0.4 - 0.2)
    return model


class BasicBlock(nn.Module):
    """ResNet basic block; one ReLU module is called twice, as in torchvision."""

    def __init__(self, inp: int, out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or inp != out:
            self.downsample = nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False),
                                            nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet18(nn.Module):
    """ResNet-18 with torchvision's layout (stem, 4 stages of 2 basic blocks, fc)."""

    def __init__(self, classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths, inp, stages = (64, 128, 256, 512), 64, []
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(BasicBlock(inp, w, stride), BasicBlock(w, w)))
            inp = w
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _conv_bn_relu6(inp: int, out: int, kernel: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inp, out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(out), nn.ReLU6())


class InvertedResidual(nn.Module):
    def __init__(self, inp: int, out: int, stride: int, expand: int):
        super().__init__()
        hidden = inp * expand
        self.use_residual = stride == 1 and inp == out
        layers = [] if expand == 1 else [_conv_bn_relu6(inp, hidden, 1)]
        layers += [_conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),
                   nn.Conv2d(hidden, out, 1, bias=False), nn.BatchNorm2d(out)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_residual else self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 (width 1.0) with torchvision's inverted-residual settings."""

    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))

    def __init__(self, classes: int = 1000):
        super().__init__()
        layers, inp = [_conv_bn_relu6(3, 32, stride=2)], 32
        for t, c, n, s in self.SETTINGS:
            for i in range(n):
                layers.append(InvertedResidual(inp, c, s if i == 0 else 1, t))
                inp = c
        layers.append(_conv_bn_relu6(inp, 1280, 1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


class TransformerEncoderNet(nn.Module):
    """A 4-layer ``nn.TransformerEncoder`` (post-norm, ReLU), spelled out so it traces.

    ``symbolic_trace`` cannot trace ``nn.TransformerEncoder.forward`` (its fast-path
    checks inspect tensor properties), and traced as a leaf it would be one opaque node.
    This module owns a real ``nn.TransformerEncoder`` and writes out exactly the math of
    its layers in eval mode, with ``nn.MultiheadAttention`` as a leaf; ``reference()``
    runs the stock module for comparison.
    """

    def __init__(self, d_model: int = 256, heads: int = 4, ff: int = 1024, layers: int = 4):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.encoder.layers:
            attn = layer.self_attn(x, x, x, need_weights=False)[0]
            x = layer.norm1(x + layer.dropout1(attn))
            ff = layer.linear2(layer.dropout(F.relu(layer.linear1(x))))
            x = layer.norm2(x + layer.dropout2(ff))
        return x

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


def _double_conv(inp: int, out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inp, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(),
                         nn.Conv2d(out, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU())


class UNet(nn.Module):
    """U-Net: 4 down and 4 up levels of double convs, skip connections joined by ``cat``."""

    def __init__(self, in_channels: int = 3, classes: int = 2, base: int = 16):
        super().__init__()
        widths = [base * 2**i for i in range(5)]
        self.downs = nn.ModuleList([_double_conv(in_channels, widths[0])] + [
            _double_conv(widths[i], widths[i + 1]) for i in range(3)])
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = _double_conv(widths[3], widths[4])
        self.ups = nn.ModuleList([nn.ConvTranspose2d(widths[i + 1], widths[i], 2, 2) for i in reversed(range(4))])
        self.up_convs = nn.ModuleList([_double_conv(2 * widths[i], widths[i]) for i in reversed(range(4))])
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for down in self.downs:
            x = down(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for up, conv, skip in zip(self.ups, self.up_convs, reversed(skips)):
            x = conv(torch.cat([skip, up(x)], dim=1))
        return self.head(x)


class DenseLayer(nn.Module):
    def __init__(self, inp: int, growth: int, bottleneck: int = 4):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(inp)
        self.relu1 = nn.ReLU()
        self.conv1 = nn.Conv2d(inp, bottleneck * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bottleneck * growth)
        self.relu2 = nn.ReLU()
        self.conv2 = nn.Conv2d(bottleneck * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(features, 1)
        return self.conv2(self.relu2(self.norm2(self.conv1(self.relu1(self.norm1(x))))))


class DenseNet(nn.Module):
    """DenseNet-BC: dense blocks whose layers each read the ``cat`` of all earlier outputs."""

    def __init__(self, blocks: tuple[int, ...] = (6, 6, 6), growth: int = 12, stem: int = 24,
                 classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, stem, 3, padding=1, bias=False), nn.BatchNorm2d(stem), nn.ReLU())
        self.blocks = nn.ModuleList()
        self.transitions = nn.ModuleList()
        channels = stem
        for i, n in enumerate(blocks):
            self.blocks.append(nn.ModuleList([DenseLayer(channels + j * growth, growth) for j in range(n)]))
            channels += n * growth
            if i < len(blocks) - 1:
                self.transitions.append(nn.Sequential(
                    nn.BatchNorm2d(channels), nn.ReLU(), nn.Conv2d(channels, channels // 2, 1, bias=False),
                    nn.AvgPool2d(2)))
                channels //= 2
        self.final = nn.Sequential(nn.BatchNorm2d(channels), nn.ReLU())
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for i, block in enumerate(self.blocks):
            features = [x]
            for layer in block:
                features.append(layer(features))
            x = torch.cat(features, 1)
            if i < len(self.transitions):
                x = self.transitions[i](x)
        x = F.adaptive_avg_pool2d(self.final(x), 1)
        return self.fc(torch.flatten(x, 1))


def resnet18() -> nn.Module:
    return reseeded(ResNet18()).eval()


def mobilenet_v2() -> nn.Module:
    return reseeded(MobileNetV2()).eval()


def transformer_encoder() -> nn.Module:
    return reseeded(TransformerEncoderNet()).eval()


def unet() -> nn.Module:
    return reseeded(UNet()).eval()


def densenet() -> nn.Module:
    return reseeded(DenseNet()).eval()


#: the zoo: name -> factory of a random-init eval-mode model
ZOO = {
    "resnet18": resnet18,
    "mobilenet_v2": mobilenet_v2,
    "transformer_encoder": transformer_encoder,
    "unet": unet,
    "densenet": densenet,
}

_INPUT_SHAPES = {
    "resnet18": (1, 3, 224, 224),
    "mobilenet_v2": (1, 3, 224, 224),
    "transformer_encoder": (1, 128, 256),
    "unet": (1, 3, 128, 128),
    "densenet": (1, 3, 64, 64),
}


def example_inputs(name: str, batch: int = 1, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A random input of the shape the zoo model ``name`` expects (batch ``batch``)."""
    if name not in _INPUT_SHAPES:
        raise KeyError(f"unknown zoo model {name!r} (known: {', '.join(_INPUT_SHAPES)})")
    shape = (batch, *_INPUT_SHAPES[name][1:])
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)),)


class DropoutBlock(nn.Module):
    """``relu(x + dropout(relu(linear(x))))``: one block of :class:`DropoutStack`."""

    def __init__(self, width: int):
        super().__init__()
        self.lin, self.relu, self.drop, self.act = nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x + self.drop(self.relu(self.lin(x))))


class DropoutStack(nn.Module):
    """``blocks`` :class:`DropoutBlock` in sequence under ``self.blocks`` (5 nodes each when
    traced): a graph of any size whose every block ``remove_dropout``, ``fuse_add_relu`` and
    ``fuse_linear_relu`` rewrite, for the report's and the benchmarks' scaling cases."""

    def __init__(self, blocks: int, width: int = 8):
        super().__init__()
        self.blocks = nn.Sequential(*[DropoutBlock(width) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def dropout_stack(blocks: int, width: int = 8) -> nn.Module:
    """A :class:`DropoutStack` in eval mode (the dropouts are the ones ``remove_dropout`` drops)."""
    return DropoutStack(blocks, width).eval()


class TransformerBlock(nn.Module):
    """A pre-norm transformer block, 12 nodes under ``symbolic_trace``: two layer norms, q/k/v/o
    linears, causal SDPA (one head) and a GELU MLP of ``mlp * d`` hidden units."""

    def __init__(self, d: int, mlp: int = 4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, mlp * d), nn.Linear(mlp * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        x = x + self.o(F.scaled_dot_product_attention(self.q(y), self.k(y), self.v(y), is_causal=True))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def transformer_stack(blocks: int, d: int, mlp: int = 4) -> nn.Module:
    """``blocks`` :class:`TransformerBlock` in sequence, in eval mode: an LLM-shaped graph of
    any size (12 nodes a block) for the optimize-cost benchmark and the large-graph tests."""
    return nn.Sequential(*[TransformerBlock(d, mlp) for _ in range(blocks)]).eval()
