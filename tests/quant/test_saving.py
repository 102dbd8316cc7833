"""A quantized model saved with ``fxopt.saving.save_program`` loads back, in both formats,
and computes what the in-memory quantized model computes; a program of another format
version is converted or refused naming both versions; a shared tensor stays shared.

Quantizing reads what it keeps of a layer (a Linear's or a conv's bias) through the layer
while the float weight is dropped, so the module tree holds torch.nn layers without their
weight; the ``code`` format must still write a folder that loads."""

import copy
import json
import shutil

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import fxopt.quant as fq
from fxopt.errors import SavedFormatError
from fxopt.saving import VERSIONS_FILE, load_program, save_program


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


# --- format versions ---------------------------------------------------------------------

def _write_versions(where, text: str | None) -> None:
    """Replace the versions file of a saved program (None: remove it, as before versions)."""
    if where.is_dir():
        if text is None:
            (where / VERSIONS_FILE).unlink()
        else:
            (where / VERSIONS_FILE).write_text(text)
        return
    program = torch.export.load(where)
    torch.export.save(program, where, extra_files={} if text is None else {VERSIONS_FILE: text})


def _int8_model(tmp_path, fmt):
    model, x = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)).eval(), torch.randn(4, 64)
    q = fq.quantize_model(model, (x,), "int8_weight_only")
    return q, save_program(q, tmp_path / "net", (x,), format=fmt)[0]


@pytest.mark.parametrize("fmt", ["code", "pt2"])
@pytest.mark.parametrize(("versions", "names"), [
    ({"fxopt_format": 7, "weights": {"int8": 1, "int4": 2}}, ["program format 7", "reads format 1"]),
    ({"fxopt_format": 1, "weights": {"int8": 3, "int4": 2}}, ["int8 weights in format version 3",
                                                              "reads int8 versions [1]", "quantize the model again"]),
    ({"fxopt_format": 1, "weights": {"int8": 1, "int4": 5}}, ["int4 weights in format version 5",
                                                              "reads int4 versions [1, 2]"]),
])
def test_a_program_of_another_version_is_refused_naming_both(tmp_path, fmt, versions, names):
    q, where = _int8_model(tmp_path, fmt)
    fresh = torch.randn(4, 64)  # pt2: the example's shapes
    torch.testing.assert_close(load_program(where)(fresh), q(fresh), rtol=0, atol=0)  # as saved: loads
    _write_versions(where, json.dumps(versions))
    with pytest.raises(SavedFormatError) as raised:
        load_program(where)
    for name in names:
        assert name in str(raised.value)
    _write_versions(where, "not json")
    with pytest.raises(SavedFormatError, match="fxopt_format.json is not what fxopt writes"):
        load_program(where)


@pytest.mark.parametrize("fmt", ["code", "pt2"])
def test_a_program_saved_before_versions_loads_where_nothing_is_ambiguous(tmp_path, fmt):
    """Format 0 (no versions file): int8 weights had one version, so they load as they are."""
    q, where = _int8_model(tmp_path, fmt)
    _write_versions(where, None)
    fresh = torch.randn(4, 64)  # pt2: the example's shapes
    assert torch.equal(load_program(where)(fresh), q(fresh))


def _pack_int4_as_before(values: torch.Tensor) -> torch.Tensor:
    """int4 packing 1 (fxopt before 2026-11-26), by its rule: byte j of a row holds the
    row's element j in its low nibble and element j + K/2 in its high one, each plus 8."""
    u = (values + 8).to(torch.uint8)
    half = u.shape[1] // 2
    return u[:, :half] | (u[:, half:] << 4)


@pytest.mark.parametrize("fmt", ["code", "pt2"])
@pytest.mark.parametrize("recorded", ["packing 1", "no versions"])
def test_int4_weights_of_the_old_packing_are_converted_on_load(tmp_path, fmt, recorded, int4_by_hand):
    """A program whose int4 weights were packed by the old rule: converted where the save
    says so (or the caller does, for a save from before versions), refused where unknown."""
    model, x = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 8)).eval(), torch.randn(4, 256)
    q = fq.quantize_model(model, (x,), "int4_weight_only")
    old = copy.deepcopy(q)
    for i, group in ((0, 128), (2, 64)):
        values, scales = int4_by_hand(model[i].weight, group)
        setattr(old, f"{i}_weight_int4", _pack_int4_as_before(values))
        setattr(old, f"{i}_weight_group_scale", scales)
    where = save_program(old, tmp_path / "old", (x,), format=fmt)[0]
    fresh = torch.randn(x.shape)  # pt2: the example's shapes
    if recorded == "packing 1":
        _write_versions(where, json.dumps({"fxopt_format": 1, "weights": {"int8": 1, "int4": 1}}))
        loaded = load_program(where)
    else:
        _write_versions(where, None)
        with pytest.raises(SavedFormatError, match=r"int4 weights but does not say their packing.*format 0.*int4_format="):
            load_program(where)
        with pytest.raises(SavedFormatError, match="int4_format=3"):
            load_program(where, int4_format=3)
        loaded = load_program(where, int4_format=1)
    torch.testing.assert_close(loaded(fresh), q(fresh), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(old(fresh), q(fresh), rtol=1e-2, atol=1e-2)  # unconverted, it is wrong


# --- shared tensors ----------------------------------------------------------------------

def _read_through_a_called_and_an_uncalled_module() -> fx.GraphModule:
    """``blocks`` (a Sequential, which ``to_folder`` pickles) is called; ``holder`` is not,
    and the graph reads the same weight through it: ``blocks(x) + x @ holder.w.T``."""
    root = nn.Module()
    root.blocks = nn.Sequential(nn.Linear(256, 256))
    root.holder = nn.Module()
    root.holder.w = root.blocks[0].weight
    graph = fx.Graph()
    x = graph.placeholder("x")
    called = graph.call_module("blocks", (x,))
    read = graph.call_function(torch.nn.functional.linear, (x, graph.get_attr("holder.w")))
    graph.output(graph.call_function(torch.add, (called, read)))
    return fx.GraphModule(root, graph)


def _bytes_on_disk(where) -> int:
    return sum(p.stat().st_size for p in where.rglob("*") if p.is_file()) if where.is_dir() else where.stat().st_size


@pytest.mark.parametrize("fmt", ["code", "pt2"])
def test_a_tensor_read_through_a_called_and_an_uncalled_module_is_saved_once_and_tied(tmp_path, fmt):
    gm = _read_through_a_called_and_an_uncalled_module()
    x = torch.randn(3, 256)
    before = gm(x)
    where = save_program(gm, tmp_path / "net", (x,), format=fmt)[0]
    assert torch.equal(gm(x), before) and gm.holder.w is gm.blocks[0].weight  # untouched
    weight_bytes = 256 * 256 * 4
    assert weight_bytes <= _bytes_on_disk(where) < 1.5 * weight_bytes  # the weight's bytes once
    loaded = load_program(where)
    weights = [t for t in loaded.state_dict(keep_vars=True).values() if t.shape == (256, 256)]
    assert len(weights) >= 2 and len({t.data_ptr() for t in weights}) == 1  # one storage
    expected = copy.deepcopy(gm)  # deepcopy keeps the tie
    with torch.no_grad():
        weights[0].mul_(2)  # an update through one reader is seen by the other
        expected.blocks[0].weight.mul_(2)
    fresh = torch.randn(x.shape)  # pt2: the example's shapes
    torch.testing.assert_close(loaded(fresh), expected(fresh))


class _TiedBias(nn.Module):
    """``a`` stays float (skipped) and is called; ``b`` is quantized, so the graph reads its
    bias, the same tensor as ``a``'s, through ``b`` without calling it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)
        self.b.bias = self.a.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu())


@pytest.mark.parametrize("fmt", ["code", "pt2"])
def test_a_bias_shared_by_a_float_layer_and_a_quantized_one_stays_one_tensor(tmp_path, fmt):
    model, x = _TiedBias().eval(), torch.randn(4, 64)
    q = fq.quantize_model(model, (x,), "int8_weight_only", skip="a")
    assert {r.name: r.mode for r in fq.summary_of(q).sites} == {"a": None, "b": "int8_weight_only"}
    loaded = load_program(save_program(q, tmp_path / "net", (x,), format=fmt)[0])
    biases = [t for t in loaded.state_dict(keep_vars=True).values()
              if t.shape == (64,) and torch.equal(t, model.a.bias)]  # not b's weight scale
    assert len(biases) >= 2 and len({t.data_ptr() for t in biases}) == 1
    with torch.no_grad():
        biases[0].add_(1.0)
        model.a.bias.add_(1.0)  # q reads the model's tensors: the same update
    fresh = torch.randn(4, 64)
    torch.testing.assert_close(loaded(fresh), q(fresh), rtol=0, atol=0)
