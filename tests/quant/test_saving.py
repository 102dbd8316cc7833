"""A quantized model saved with ``fxopt.saving.save_program`` loads back, in both formats,
and computes what the in-memory quantized model computes.

Quantizing reads what it keeps of a layer (a Linear's or a conv's bias) through the layer
while the float weight is dropped, so the module tree holds torch.nn layers without their
weight; the ``code`` format must still write a folder that loads."""

import shutil

import pytest
import torch
import torch.nn as nn

import fxopt.quant as fq
from fxopt.saving import load_program, save_program


class _ConvMlp(nn.Module):
    """A conv (quantized as conv + dequantized weight, its bias read through the module), a
    top-level Linear, Linears inside a Sequential beside a GELU module, and a head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv1d(3, 8, 3)
        self.patch = nn.Linear(128, 64)
        self.blocks = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch(self.stem(x).flatten(1))
        return self.head(self.blocks(h).relu())


def _inputs(batch: int = 4) -> torch.Tensor:
    return torch.randn(batch, 3, 18)


#: the routes that run on CPU: mode and quantize_model options
ROUTES = {
    "int8_weight_only": ("int8_weight_only", {}),
    "int8_weight_only_dynamic_min_tokens": ("int8_weight_only", {"dynamic_min_tokens": 3}),
    "int8_dynamic": ("int8_dynamic", {}),
    "int4_weight_only": ("int4_weight_only", {}),
    "int8_static": ("int8_static", {"calibration_data": [(_inputs(),) for _ in range(4)]}),
}


def _tensors(module: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return sorted((str(t.dtype), tuple(t.shape)) for t in module.state_dict().values())


@pytest.mark.parametrize("fmt", ["code", "pt2"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_saved_quantized_model_loads_back_and_computes_the_same(tmp_path, route, fmt):
    mode, options = ROUTES[route]
    x = _inputs()
    q = fq.quantize_model(_ConvMlp().eval(), (x,), mode, **options)
    assert fq.summary_of(q).quantized_flops > 0
    code, modules = q.code, [name for name, _ in q.named_modules()]

    written, kind = save_program(q, tmp_path / "here" / "net", (x,), format=fmt)
    assert kind == fmt
    moved = shutil.move(written, tmp_path / "elsewhere")  # the folder (or file) works anywhere
    loaded = load_program(moved)

    assert q.code == code and [name for name, _ in q.named_modules()] == modules  # untouched
    # the same tensors (int8/int4 weights, scales, biases): no float weight brought back
    assert _tensors(loaded) == _tensors(q)
    # pt2 has the example's static shapes; the code format takes any batch size
    batches = (4, 4) if fmt == "pt2" else (4, 1, 7)
    with torch.no_grad():
        for batch in batches:
            fresh = _inputs(batch)
            # the same ops on the same tensors, on CPU: bitwise the same
            assert torch.equal(loaded(fresh), q(fresh)), (route, fmt, batch)
