"""The ``insert_observers`` and ``quantize`` passes.

Flow for static int8 (activations need calibrated ranges)::

    gm = fxopt.optimize(model, ["insert_observers"], example_inputs=inputs)
    fxopt.quant.calibrate(gm, batches)
    gm = fxopt.optimize(gm, ["quantize{mode=int8_static}"], example_inputs=inputs)

Dynamic int8 and weight-only int8 need no calibration: ``quantize`` alone.
:func:`fxopt.quant.quantize_model` runs the whole flow in one call.

What ``quantize`` emits per site (see :mod:`fxopt.quant.sites`; ops in
:mod:`fxopt.quant.ops`). Linear-like sites (2-D weight: ``nn.Linear``, ``F.linear``,
``@``, ``mm``, ``addmm``) become one linear with the weight stored int8 ``[N, K]`` and one
float32 scale per output channel:

- ``int8_static``: ``F.linear(dequantize(quantize(x)), dequantize(w_int8), bias)``
  with the activation's observed scale/zero point (QDQ: the portable reference form);
- ``int8_dynamic``: ``int8_dynamic_linear(x, w_int8, scale, bias)`` (per-token activation
  scales computed at run time, fxopt's Triton int8 GEMM on the GPU);
- ``int8_weight_only``: ``int8_weight_only_linear(x, w_int8, scale, bias)`` (a fused
  Triton kernel on the GPU), or ``int8_linear`` when ``dynamic_min_tokens`` picks the
  route by the number of rows.

Other sites (convolutions, ``bmm``, N-D ``matmul``) keep their op and get
``dequantize(w_int8)`` for the weight, plus QDQ of the activation in the static and
dynamic modes (dynamic: one scale per tensor, computed at run time).

Every site not quantized is reported with its reason, in the pass's stats and in
``gm.meta["fxopt.quant"]`` (a :class:`QuantSummary`).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxopt.analysis.shapes import record_value
from fxopt.errors import InputError
from fxopt.graph_utils import drop_unused_attributes, fetch_attr, fresh_attr_name
from fxopt.pass_protocol import Option, Pass, PassResult
from fxopt.provenance import record_replacement
from fxopt.quant.formats import AUTO_GROUP_SIZE, INT8_SYMMETRIC_MAX, int4_group_size, pack_int4
from fxopt.quant.observers import OBSERVERS, Observer, qparams_from_range, qrange
from fxopt.quant.ops import ops
from fxopt.quant.sites import Site, find_sites, is_weight_view
from fxopt.registry import register_pass

INT8_MODES = ("int8_static", "int8_dynamic", "int8_weight_only")
MODES = (*INT8_MODES, "int4_weight_only")
SUMMARY_KEY = "fxopt.quant"
SITE_KEY = "fxopt.quant.site"
#: options shared by both passes: which sites are quantized, and how
SELECTION_OPTIONS = {
    "mode": Option(str, "int8_weight_only", "quantization mode", choices=MODES),
    "skip": Option(str, "", "comma-separated globs of node names or module paths kept in float"),
    "keep_first_last": Option(bool, False, "keep the first and last eligible matmul in float"),
    "overrides": Option(str, "", "per-node modes: 'glob=mode;glob=float;...' (first match wins)"),
}


@dataclass
class SiteRecord:
    """What happened to one eligible matmul."""

    name: str
    kind: str
    module: str
    flops: int
    mode: str | None  # None: not quantized
    reason: str | None  # why not quantized
    weight: str | None
    shared_with: str | None = None  # the first site that quantized the same weight
    group_size: int | None = None  # int4_weight_only: values per scale along K


@dataclass
class QuantSummary:
    """Coverage of a quantize run: quantized FLOPs over eligible FLOPs, and every skip."""

    sites: list[SiteRecord] = field(default_factory=list)

    @property
    def eligible_flops(self) -> int:
        return sum(s.flops for s in self.sites if s.weight is not None)

    @property
    def quantized_flops(self) -> int:
        return sum(s.flops for s in self.sites if s.mode is not None)

    @property
    def coverage(self) -> float:
        """Fraction of the FLOPs of constant-weight matmuls that run quantized."""
        return self.quantized_flops / self.eligible_flops if self.eligible_flops else 0.0

    @property
    def skipped(self) -> dict[str, str]:
        return {s.name: s.reason for s in self.sites if s.mode is None}


def _selected_mode(site: Site, options: dict[str, Any], position: str | None) -> tuple[str | None, str | None]:
    """(mode, None) for a site to quantize, or (None, reason) for one kept in float."""
    if site.skip is not None:
        return None, site.skip
    names = [site.name] + ([site.module_path] if site.module_path else [])
    for glob in filter(None, (g.strip() for g in options["skip"].split(","))):
        if any(fnmatch.fnmatchcase(n, glob) for n in names):
            return None, f"in the skip list ({glob!r})"
    if position is not None:
        return None, f"kept in float: {position} layer (keep_first_last)"
    for rule in filter(None, (r.strip() for r in options["overrides"].split(";"))):
        glob, _, mode = rule.partition("=")
        if any(fnmatch.fnmatchcase(n, glob.strip()) for n in names):
            mode = mode.strip()
            if mode == "float":
                return None, f"kept in float by override {rule!r}"
            if mode not in MODES:
                raise InputError(f"quantize: override {rule!r} names unknown mode {mode!r}; "
                                 f"use one of {', '.join(MODES)} or float")
            return mode, None
    return options["mode"], None


def plan(gm: fx.GraphModule, options: dict[str, Any]) -> list[tuple[Site, str | None, str | None]]:
    """Every site with the mode it gets (or None) and the reason it is skipped (or None)."""
    sites = find_sites(gm)
    eligible = [s for s in sites if s.skip is None]
    ends = {}
    if options["keep_first_last"] and eligible:
        ends = {eligible[-1].name: "last", eligible[0].name: "first"}
    planned = []
    for site in sites:
        mode, reason = _selected_mode(site, options, ends.get(site.name))
        if mode == "int4_weight_only":
            group, why = site_group_size(site, options)
            if group is None:
                mode, reason = None, why
        planned.append((site, mode, reason))
    return planned


def site_group_size(site: Site, options: dict[str, Any]) -> tuple[int | None, str | None]:
    """The int4 group size of a site, or ``(None, why int4 weight-only cannot take it)``:
    it packs 2-D weights in groups along K (:func:`fxopt.quant.formats.int4_group_size`)."""
    if not site.spelling.linear_like:
        return None, f"int4_weight_only covers linear-like matmuls only, not {site.spelling.kind}"
    return int4_group_size(site.weight_nk().shape[1], options.get("group_size", AUTO_GROUP_SIZE))


def nothing_quantized(pass_name: str, planned: list[tuple[Site, str | None, str | None]]) -> str | None:
    """What to tell the user when a plan quantizes no site (every site's reason), or None.

    One rule for both flows: post-training ``quantize`` warns with it (its result is a
    float model) and ``prepare_qat`` raises it (training with no fake quantization is
    never what was asked for)."""
    if any(mode for _, mode, _ in planned):
        return None
    reasons = "; ".join(f"{site.name}: {why}" for site, _, why in planned) or "the graph has no matmul"
    return f"{pass_name}: no quantizable site, nothing to quantize ({reasons})"


@register_pass
class InsertObservers(Pass):
    """Insert observers in front of the activations that static int8 quantization will quantize.

    Run calibration data through the result (``fxopt.quant.calibrate``), then ``quantize``.
    An activation feeding several matmuls gets one observer.
    """

    name = "insert_observers"
    options = {
        **SELECTION_OPTIONS,
        "mode": Option(str, "int8_static", "default mode (observers go where it is int8_static)",
                       choices=MODES),
        "observer": Option(str, "minmax", "range estimator", choices=tuple(OBSERVERS)),
        "percentile": Option(float, 99.99, "histogram observer: percentile kept on each side"),
        "symmetric": Option(bool, False, "symmetric activation ranges (zero point 0)"),
        "per_channel": Option(bool, False, "one activation range per channel (axis 1 for conv, last otherwise)"),
    }
    requires = ("shapes",)
    inference_only = True

    def _observer(self, site: Site) -> Observer:
        cls = OBSERVERS[self.options["observer"]]
        ch_axis = (1 if site.spelling.kind == "conv" else -1) if self.options["per_channel"] else None
        kwargs = {"percentile": self.options["percentile"]} if cls.__name__ == "HistogramObserver" else {}
        return cls(symmetric=self.options["symmetric"], ch_axis=ch_axis, **kwargs)

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        observed: dict[fx.Node, fx.Node] = {}
        for site, mode, _ in plan(gm, self.options):
            if mode != "int8_static" or site.act is None:
                continue
            if site.act not in observed:
                name = fresh_attr_name(gm, f"{site.act.name}_observer")
                gm.add_submodule(name, self._observer(site))
                with gm.graph.inserting_after(site.act):
                    obs = gm.graph.call_module(name, (site.act,))
                obs.meta.update({k: v for k, v in site.act.meta.items() if k in ("val", "tensor_meta")})
                observed[site.act] = obs
            site.node.replace_input_with(site.act, observed[site.act])
        return PassResult(bool(observed), {"observers": len(observed)})


class _Builder:
    """Emits the quantized form of each site into ``gm``; quantizes each weight once."""

    def __init__(self, gm: fx.GraphModule, fake_mode: Any, options: dict[str, Any],
                 weight_scales: dict[tuple, torch.Tensor] | None = None):
        self.gm, self.graph, self.fake_mode = gm, gm.graph, fake_mode
        self.weight_scales = weight_scales or {}
        self.per_channel = options["per_channel"]
        self.dynamic_min_tokens = options["dynamic_min_tokens"]
        self.options = options
        self.weights: dict[tuple, tuple[str, str, str]] = {}  # key -> (int8, scale, first site)
        self.zero: str | None = None
        # sites come in graph order, so a node made for an earlier site comes before every
        # later one and may be reused by it: get_attr nodes, and the static QDQ of an
        # activation that feeds several sites
        self.nodes: dict[str, fx.Node] = {}
        self.static_qdq: dict[fx.Node, fx.Node] = {}

    def attr(self, name: str, value: torch.Tensor) -> str:
        name = fresh_attr_name(self.gm, name)
        self.gm.register_buffer(name, value)
        return name

    def get(self, target: str) -> fx.Node:
        if target not in self.nodes:
            node = self.nodes[target] = self.graph.get_attr(target)
            record_value(node, self.fake_mode.from_tensor(fetch_attr(self.gm, target), static_shapes=True))
        return self.nodes[target]

    def group_size(self, site: Site) -> int:
        """The int4 group size of a site that ``plan`` let through (so it has one)."""
        return site_group_size(site, self.options)[0]

    def zero_point(self) -> fx.Node:
        if self.zero is None:
            self.zero = self.attr("quant_zero_point", torch.zeros(()))
        return self.get(self.zero)

    def quantized_weight(self, site: Site, linear: bool, int4: bool = False) -> tuple[str, str, str | None]:
        """(int8 attr, scale attr, site it was first quantized for, if shared)."""
        key = (id(site.weight), linear, site.stored_contracted(), int4)  # tied weights share a tensor
        if key in self.weights:
            q, s, first = self.weights[key]
            return q, s, first
        base = site.weight_key.replace(".", "_")
        given = self.weight_scales.get((id(site.weight), site.stored_contracted(), int4))
        if int4:
            packed, scales = pack_int4(site.weight_nk(), self.group_size(site), given)
            q, s = self.attr(f"{base}_int4", packed), self.attr(f"{base}_group_scale", scales)
            self.weights[key] = (q, s, site.name)
            return q, s, None
        w = (site.weight_nk() if linear else site.weight).detach().to(torch.float32)
        reduce = (1,) if linear else site.stored_contracted()
        if not self.per_channel:
            reduce = tuple(range(w.dim()))
        if given is not None:  # [C] or [1]: shaped like the reduction below
            scale = given.reshape(-1, 1) if linear else given.reshape(
                [1 if a in reduce else n for a, n in enumerate(w.shape)])
        else:
            lo, hi = w.amin(dim=reduce, keepdim=True), w.amax(dim=reduce, keepdim=True)
            scale, _ = qparams_from_range(lo, hi, symmetric=True)
        wq = torch.clamp(torch.round(w / scale), -INT8_SYMMETRIC_MAX, INT8_SYMMETRIC_MAX).to(torch.int8)
        if linear:
            scale = scale.reshape(-1).expand(w.shape[0]).contiguous()
            wq = wq.contiguous()
        q, s = self.attr(f"{base}_int8", wq), self.attr(f"{base}_scale", scale)
        self.weights[key] = (q, s, site.name)
        return q, s, None

    def qdq_static(self, x: fx.Node, observer: Observer) -> fx.Node:
        if x not in self.static_qdq:
            self.static_qdq[x] = self._qdq_static(x, observer)
        return self.static_qdq[x]

    def _qdq_static(self, x: fx.Node, observer: Observer) -> fx.Node:
        scale, zp = observer.qparams()
        qmin, qmax = qrange(observer.symmetric)
        s, z = self.attr(f"{x.name}_act_scale", scale), self.attr(f"{x.name}_act_zero_point", zp)
        q = self.graph.call_function(ops.quantize.default, (x, self.get(s), self.get(z), qmin, qmax))
        return self.graph.call_function(ops.dequantize.default, (q, self.get(s), self.get(z), x.meta["val"].dtype))

    def qdq_dynamic(self, x: fx.Node) -> fx.Node:
        dims = list(range(x.meta["val"].dim()))
        s = self.graph.call_function(ops.dynamic_scale.default, (x, dims, INT8_SYMMETRIC_MAX))
        z = self.zero_point()
        q = self.graph.call_function(ops.quantize.default, (x, s, z, -INT8_SYMMETRIC_MAX, INT8_SYMMETRIC_MAX))
        return self.graph.call_function(ops.dequantize.default, (q, s, z, x.meta["val"].dtype))

    def emit(self, site: Site, mode: str) -> tuple[fx.Node, str | None]:
        """Build the site's quantized form before it; return (output node, shared-with)."""
        linear = site.spelling.linear_like
        x = site.current_act()
        observer = None
        if x.op == "call_module" and isinstance(self.gm.get_submodule(x.target), Observer):
            observer = self.gm.get_submodule(x.target)
            x = x.args[0]
        with self.graph.inserting_before(site.node):
            q_name, s_name, shared = self.quantized_weight(site, linear, mode == "int4_weight_only")
            wq, ws = self.get(q_name), self.get(s_name)
            bias = self._bias(site)
            if mode == "int8_static":
                x = self.qdq_static(x, observer)
            elif mode == "int8_dynamic" and not linear:
                x = self.qdq_dynamic(x)
            if mode == "int4_weight_only":
                out = self.graph.call_function(ops.int4_weight_only_linear.default,
                                               (x, wq, ws, self.group_size(site), bias))
            elif linear and mode == "int8_weight_only":
                if self.dynamic_min_tokens > 0:
                    out = self.graph.call_function(ops.int8_linear.default,
                                                   (x, wq, ws, bias, self.dynamic_min_tokens))
                else:
                    out = self.graph.call_function(ops.int8_weight_only_linear.default, (x, wq, ws, bias))
            elif linear and mode == "int8_dynamic":
                out = self.graph.call_function(ops.int8_dynamic_linear.default, (x, wq, ws, bias))
            else:
                dtype = site.weight.dtype
                scale = self.graph.call_method("unsqueeze", (ws, 1)) if linear else ws
                w = self.graph.call_function(ops.dequantize.default, (wq, scale, self.zero_point(), dtype))
                out = self._rebuild(site, x, w, bias) if linear or site.node.op == "call_module" \
                    else self._reroute(site, x, w)
        return out, shared

    def _bias(self, site: Site) -> fx.Node | None:
        if site.node.op == "call_module":
            mod = self.gm.get_submodule(site.node.target)
            return self.get(f"{site.node.target}.bias") if mod.bias is not None else None
        return site.bias

    def _rebuild(self, site: Site, x: fx.Node, w: fx.Node, bias: fx.Node | None) -> fx.Node:
        """A functional linear/conv replacing a module, or any linear-like spelling."""
        if site.spelling.linear_like:
            return self.graph.call_function(F.linear, (x, w, bias))
        mod = self.gm.get_submodule(site.node.target)
        conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[mod.weight.dim() - 2]
        return self.graph.call_function(conv, (x, w, bias, mod.stride, mod.padding, mod.dilation, mod.groups))

    def _reroute(self, site: Site, x: fx.Node, w: fx.Node) -> fx.Node:
        """A copy of the site's node reading the dequantized weight (through its views)."""
        value = w
        for view in site.weight_path:
            value = self.graph.node_copy(view, lambda n, v=value, old=view: v if n is old.args[0] else n)
        feed = site.weight_path[-1] if site.weight_path else site.weight_root
        replace = {feed: value, site.current_act(): x}
        return self.graph.node_copy(site.node, lambda n: replace.get(n, n))


@register_pass
class Quantize(Pass):
    """Quantize every matmul with a constant weight: int8 static QDQ, dynamic or weight-only; int4 weight-only.

    Sites are every spelling of a matmul with a constant weight (see fxopt.quant.sites);
    skipped ones are reported with their reason in the stats and gm.meta['fxopt.quant'].
    """

    name = "quantize"
    options = {
        **SELECTION_OPTIONS,
        "per_channel": Option(bool, True, "one weight scale per output channel (else per tensor)"),
        "group_size": Option(int, AUTO_GROUP_SIZE, "int4_weight_only: weights per scale along K; "
                             "0: per site, the largest of 128, 64, 32 dividing K", choices=(0, 32, 64, 128, 256)),
        "dynamic_min_tokens": Option(int, 0, "weight-only mode: use int8 dynamic (int8 tensor cores) "
                                              "for inputs with at least this many rows; 0 = never"),
    }
    requires = ("shapes",)
    inference_only = True

    def __init__(self, weight_scales: dict[tuple, torch.Tensor] | None = None, **options: Any):
        """``weight_scales``: scales chosen before ``quantize`` runs (quantization-aware
        training learns them), ``{(id(stored weight), contracted axes, int4): scale}``, the
        scale shaped ``[C]`` (one per output channel, the stored weight's non-contracted axes
        in order), ``[1]`` (per tensor) or ``[N, K / group_size]`` (int4). Keyed by tensor
        identity, so a Python argument, not a textual option."""
        super().__init__(**options)
        self.weight_scales = weight_scales

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        planned = plan(gm, self.options)
        observers = [n for n in gm.graph.nodes
                     if n.op == "call_module" and isinstance(gm.get_submodule(n.target), Observer)]
        needs_observers = any(mode == "int8_static" for _, mode, _ in planned)
        if needs_observers and not observers:
            raise InputError("quantize: int8_static needs calibrated observers; run insert_observers, "
                             "then fxopt.quant.calibrate(gm, data), then quantize")
        if message := nothing_quantized(self.name, planned):
            ctx.warn(message)
        builder = _Builder(gm, ctx.analysis("shapes"), self.options, self.weight_scales)
        summary = QuantSummary()
        for site, mode, reason in planned:
            if mode == "int8_static" and site.current_act() not in observers:
                mode, reason = None, "int8_static but its activation has no observer (insert_observers first)"
            record = SiteRecord(site.name, site.spelling.kind, site.module_path, site.flops, mode,
                                reason, site.weight_key)
            summary.sites.append(record)
            if mode is None:
                continue
            if mode == "int4_weight_only":
                record.group_size = builder.group_size(site)
            out, record.shared_with = builder.emit(site, mode)
            out.meta[SITE_KEY] = site.name
            if isinstance(site.node.meta.get("val"), torch.Tensor):
                record_value(out, site.node.meta["val"])
            site.node.replace_all_uses_with(out)
            record_replacement(out, [site.node], self.name)
            gm.graph.erase_node(site.node)
        self._remove_observers(gm, observers)
        _remove_dead_weights(gm)
        gm.meta[SUMMARY_KEY] = summary
        stats = {"quantized": sum(r.mode is not None for r in summary.sites),
                 "skipped": summary.skipped, "coverage": round(summary.coverage, 4),
                 "shared_weights": sum(r.shared_with is not None for r in summary.sites)}
        groups = {r.name: r.group_size for r in summary.sites if r.group_size is not None}
        if groups:
            stats["int4_group_sizes"] = groups
        return PassResult(stats["quantized"] > 0 or bool(observers), stats)

    @staticmethod
    def _remove_observers(gm: fx.GraphModule, observers: list[fx.Node]) -> None:
        for node in observers:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def _remove_dead_weights(gm: fx.GraphModule) -> None:
    """Drop the unused weight views, get_attr nodes and what only they kept alive, so float
    copies of quantized weights are not carried along (the tensors stay shared with the
    user's model; nothing is written in place)."""
    for node in reversed(list(gm.graph.nodes)):
        if not node.users and is_weight_view(node):
            gm.graph.erase_node(node)
    drop_unused_attributes(gm)
