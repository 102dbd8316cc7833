"""Finding quantizable matmuls: every spelling of "activation times constant weight".

A *site* is a node that multiplies an activation by a constant weight, whatever it is
spelled as: ``nn.Linear``/``nn.ConvNd`` modules, ``F.linear``, ``torch.matmul``, ``@``,
``mm``, ``addmm``, ``bmm``, ``F.convNd`` at the torch level, and ``aten.linear``,
``aten.mm`` (usually of ``aten.t(weight)``), ``aten.addmm``, ``aten.bmm``,
``aten.convolution`` at the ATen level (``torch.export``, ``make_fx``). The spellings are
one table, :data:`SPELLINGS`: where the activation, weight and bias are in the
arguments, and which axes of the weight are contracted (summed over); the remaining
weight axes are the output channels that per-channel scales index.

"Constant" means a ``get_attr`` (a parameter, buffer or tensor attribute), possibly seen
through transposes/permutes, or a module's own weight. Eligible nodes that cannot be
quantized carry a ``skip`` reason instead of being dropped silently.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

aten = torch.ops.aten


@dataclass(frozen=True)
class Spelling:
    """Where a matmul spelling keeps its operands, and how its weight is contracted.

    ``contracted`` indexes the weight *as the op sees it*; ``linear_like`` means the op
    is ``x @ W.T`` for a 2-D weight (so it can become a fused int8 linear), in which case
    ``weight_is_nk`` says whether the weight as seen is ``[N, K]`` (linear) or ``[K, N]``.
    """

    kind: str
    act: tuple[int, str]  # (position, keyword) of the activation
    weight: tuple[int, str]
    bias: tuple[int, str] | None
    contracted: tuple[int, ...] | None  # None: all but the first (conv)
    linear_like: bool
    weight_is_nk: bool = False


_LINEAR = Spelling("linear", (0, "input"), (1, "weight"), (2, "bias"), (-1,), True, weight_is_nk=True)
_MATMUL = Spelling("matmul", (0, "input"), (1, "other"), None, (-2,), True)
_MM = Spelling("matmul", (0, "input"), (1, "mat2"), None, (-2,), True)
_ADDMM = Spelling("addmm", (1, "mat1"), (2, "mat2"), (0, "input"), (-2,), True)
_BMM = Spelling("bmm", (0, "input"), (1, "mat2"), None, (-2,), False)
_CONV = Spelling("conv", (0, "input"), (1, "weight"), (2, "bias"), None, False)

#: call_function targets and call_method names, torch level and ATen level
SPELLINGS: dict[object, Spelling] = {
    F.linear: _LINEAR, aten.linear.default: _LINEAR,
    torch.matmul: _MATMUL, operator.matmul: _MATMUL, aten.matmul.default: _MATMUL, "matmul": _MATMUL,
    torch.mm: _MM, aten.mm.default: _MM, "mm": _MM,
    torch.addmm: _ADDMM, aten.addmm.default: _ADDMM, "addmm": _ADDMM,
    torch.bmm: _BMM, aten.bmm.default: _BMM, "bmm": _BMM,
    F.conv1d: _CONV, F.conv2d: _CONV, F.conv3d: _CONV,
    aten.conv1d.default: _CONV, aten.conv2d.default: _CONV, aten.conv3d.default: _CONV,
    aten.convolution.default: _CONV,
}

#: weight views seen through when looking for a constant: target -> permutation maker
_VIEWS = {
    torch.t: lambda nd, a: (1, 0), aten.t.default: lambda nd, a: (1, 0), "t": lambda nd, a: (1, 0),
    torch.transpose: lambda nd, a: _swap(nd, *a), aten.transpose.int: lambda nd, a: _swap(nd, *a),
    "transpose": lambda nd, a: _swap(nd, *a),
    torch.permute: lambda nd, a: _dims(nd, a), aten.permute.default: lambda nd, a: _dims(nd, a),
    "permute": lambda nd, a: _dims(nd, a),
    # ``w.T`` / ``w.mT`` trace as getattr(w, "T") (symbolic_trace)
    getattr: lambda nd, a: tuple(reversed(range(nd))) if a[0] == "T" else _swap(nd, -2, -1),
}


def _swap(ndim: int, d0: int, d1: int) -> tuple[int, ...]:
    perm = list(range(ndim))
    perm[d0 % ndim], perm[d1 % ndim] = perm[d1 % ndim], perm[d0 % ndim]
    return tuple(perm)


def _dims(ndim: int, args: tuple) -> tuple[int, ...]:
    dims = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
    return tuple(d % ndim for d in dims)


@dataclass
class Site:
    """One eligible matmul: what it multiplies, how, and whether it will be quantized."""

    node: fx.Node
    spelling: Spelling
    act: fx.Node | None
    weight: torch.Tensor | None  # the stored constant (None if not constant)
    weight_key: str | None  # identity used to quantize a shared weight once
    weight_root: fx.Node | None  # the get_attr node (None for call_module sites)
    weight_path: list[fx.Node] = field(default_factory=list)  # view nodes root -> site
    perm: tuple[int, ...] = ()  # used weight = stored weight.permute(perm)
    bias: fx.Node | None = None
    flops: int = 0
    skip: str | None = None

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def module_path(self) -> str:
        return str(self.node.target) if self.node.op == "call_module" else ""

    def current_act(self) -> fx.Node:
        """The activation argument as the graph holds it now (earlier rewrites replace
        the nodes it was computed by)."""
        if self.node.op == "call_module":
            return self.node.args[0]
        return _arg(self.node, self.spelling.act)

    def stored_contracted(self) -> tuple[int, ...]:
        """The contracted axes in the stored weight's coordinates."""
        nd = self.weight.dim()
        used = self.spelling.contracted or tuple(range(1, nd))
        return tuple(sorted(self.perm[a % nd] for a in used))

    def weight_nk(self) -> torch.Tensor:
        """A linear-like site's weight as ``[N, K]`` (what the fused int8 linear takes)."""
        used = self.weight.permute(self.perm)
        return used if self.spelling.weight_is_nk else used.t()


def _arg(node: fx.Node, where: tuple[int, str] | None):
    if where is None:
        return None
    index, name = where
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name)


def is_weight_view(node: fx.Node) -> bool:
    """Whether ``node`` is a transpose/permute of the kind weights are seen through."""
    if node.op not in ("call_function", "call_method") or node.target not in _VIEWS:
        return False
    return node.target is not getattr or node.args[1] in ("T", "mT")


def _constant(gm: fx.GraphModule, value) -> tuple[torch.Tensor, str, fx.Node, list[fx.Node], tuple] | None:
    """(tensor, key, get_attr node, view path, permutation) if ``value`` is a constant."""
    path: list[fx.Node] = []
    node = value
    while isinstance(node, fx.Node) and is_weight_view(node) and isinstance(node.args[0], fx.Node):
        path.append(node)
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return None
    try:
        tensor = operator.attrgetter(node.target)(gm)
    except AttributeError:
        return None
    if not isinstance(tensor, torch.Tensor):
        return None
    perm = tuple(range(tensor.dim()))
    for view in reversed(path):
        step = _VIEWS[view.target](len(perm), tuple(view.args[1:]))
        perm = tuple(perm[i] for i in step)
    return tensor, str(node.target), node, list(reversed(path)), perm


def _module_site(gm: fx.GraphModule, node: fx.Node) -> Site | None:
    mod = gm.get_submodule(node.target)
    if isinstance(mod, nn.Linear):
        spelling, reason = _LINEAR, None
    elif isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        spelling = _CONV
        reason = None if mod.padding_mode == "zeros" else f"padding_mode={mod.padding_mode!r} is not supported"
    elif isinstance(mod, nn.modules.conv._ConvNd):
        spelling, reason = _CONV, f"{type(mod).__name__} (transposed convolution) is not supported"
    elif _hides_matmuls(mod):
        return Site(node, _LINEAR, None, None, None, None,
                    skip=f"matmuls inside the leaf module {type(mod).__name__} are invisible to "
                         "symbolic_trace; capture with torch.export to quantize them")
    else:
        return None
    act = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    site = Site(node, spelling, act, mod.weight, f"{node.target}.weight", None,
                perm=tuple(range(mod.weight.dim())), skip=reason)
    return site


def _hides_matmuls(mod: nn.Module) -> bool:
    """A leaf module (kept whole by symbolic_trace) that multiplies by weight matrices:
    nn.MultiheadAttention, nn.TransformerEncoderLayer, RNNs, nn.Bilinear...; embeddings
    are lookups, not matmuls."""
    if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)):
        return False
    return any(p.dim() >= 2 for p in mod.parameters())


def _function_site(gm: fx.GraphModule, node: fx.Node) -> Site | None:
    spelling = SPELLINGS.get(node.target)
    if spelling is None:
        return None
    act = _arg(node, spelling.act)
    weight_arg = _arg(node, spelling.weight)
    found = _constant(gm, weight_arg)
    site = Site(node, spelling, act if isinstance(act, fx.Node) else None, None, None, None)
    if found is None:
        site.skip = ("the constant is the left operand" if _constant(gm, act) is not None
                     else "the weight is not a constant (it is computed or a graph input)")
        return site
    site.weight, site.weight_key, site.weight_root, site.weight_path, site.perm = found
    bias = _arg(node, spelling.bias)
    site.bias = bias if isinstance(bias, fx.Node) else None
    if spelling.kind == "addmm" and (node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1):
        site.skip = "addmm with beta/alpha other than 1"
    if node.target is aten.convolution.default and node.args[6]:
        site.skip = "transposed convolution is not supported"
    if site.act is None:
        site.skip = "the activation is not a tensor node"
    elif site.act.op == "get_attr" and site.skip is None:
        site.skip = "both operands are constant (constant_fold handles it)"
    return site


def _check_types(site: Site) -> None:
    w = site.weight
    act_val = site.act.meta.get("val") if site.act is not None else None
    if w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        site.skip = f"weight dtype {w.dtype} is not float32/float16/bfloat16"
    elif isinstance(act_val, torch.Tensor) and act_val.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        site.skip = f"activation dtype {act_val.dtype} is not float32/float16/bfloat16"
    elif w.dim() < 2:
        site.skip = f"{w.dim()}-D weight has no output channels"
    elif site.spelling.linear_like and w.dim() != 2:
        site.skip = f"{w.dim()}-D weight in {site.spelling.kind}: only 2-D weights are quantized"


def _flops(site: Site) -> int:
    out = site.node.meta.get("val")
    if not isinstance(out, torch.Tensor) or site.weight is None or site.weight.dim() == 0:
        return 0
    k = math.prod(site.weight.shape[a] for a in site.stored_contracted()) if site.weight.dim() >= 2 else 1
    return 2 * int(out.numel()) * int(k)


def find_sites(gm: fx.GraphModule) -> list[Site]:
    """Every matmul-like node of ``gm`` with its quantizability (``skip`` reason or None)."""
    sites = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            site = _module_site(gm, node)
        elif node.op in ("call_function", "call_method"):
            site = _function_site(gm, node)
        else:
            continue
        if site is None:
            continue
        if site.weight is not None and site.skip is None:
            _check_types(site)
        site.flops = _flops(site)
        sites.append(site)
    return sites
