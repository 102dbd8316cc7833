"""Quantization-aware training: fake quantization on a training graph, then the same
lowering as post-training quantization.

``prepare_qat`` captures a train-mode model (``symbolic_trace``, or a ``torch.export``
training graph), finds the sites the post-training path finds (:func:`fxopt.quant.passes.plan`
over :data:`fxopt.quant.SPELLINGS`, with the same ``skip``/``keep_first_last``/``overrides``)
and inserts fake quantization (:mod:`fxopt.quant.fake_quant`) where the lowering will
quantize:

- every quantized weight passes through a :class:`WeightFakeQuant` (int8 per channel or
  per tensor, int4 per group), placed on the stored weight before any transpose, so its
  layout is the lowering's;
- an ``int8_static`` activation passes through one :class:`ActivationFakeQuant` (an
  observer, so ``quantize`` reads its range like a calibrated one); an ``int8_dynamic``
  one through a :class:`DynamicFakeQuant`;
- a convolution followed by a train-mode BatchNorm is folded as PyTorch's QAT folds it:
  the weight is scaled by ``gamma / sqrt(running_var + eps)`` before fake quantization, the
  convolution's output is divided by the same factor, and the BatchNorm runs on it as
  before (batch statistics, running statistics updated) until it is frozen; then it uses
  the running statistics and the block computes exactly the folded convolution.

Module sites (``nn.Linear``, ``nn.ConvNd``) become their functional form on the module's
parameters (same node names), so one rewrite covers every capture path.

``convert_qat`` folds the BatchNorms into new conv weights, hands the trained weight scales
to the ``quantize`` pass (its ``weight_scales`` argument), and runs it: the result is the graph the
post-training path makes, with the same ops and kernels.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxopt.analysis.ops import mutated_inputs
from fxopt.errors import InputError, PassOptionError
from fxopt.graph_utils import fetch_attr, fresh_attr_name
from fxopt.manager import PassManager
from fxopt.optimize import as_graph_module
from fxopt.pass_protocol import Option, Pass, PassResult
from fxopt.patterns import ParamRef, canonicalize
from fxopt.patterns.stock import bn_scale, fold_bias, fold_weight
from fxopt.quant.fake_quant import ActivationFakeQuant, DynamicFakeQuant, WeightFakeQuant
from fxopt.quant.passes import SELECTION_OPTIONS, Quantize, nothing_quantized, plan, site_group_size
from fxopt.quant.sites import Site

#: ``gm.meta`` key of the conv + BatchNorm pairs ``prepare_qat`` folded
FOLDS_KEY = "fxopt.qat.folds"


@dataclass(frozen=True)
class Fold:
    """A convolution and the BatchNorm after it, folded for training (node names)."""

    conv: str
    bn: str
    unscale: str  # the node dividing the conv output by the BatchNorm factor


def unscale_conv(y: torch.Tensor, gamma: torch.Tensor | None, var: torch.Tensor, eps: float,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """The output of the unfolded convolution, from the folded one: ``y / (gamma /
    sqrt(var + eps)) + bias`` per channel (dim 1)."""
    shape = [1, -1] + [1] * (y.dim() - 2)
    out = y / bn_scale(gamma, var, eps).reshape(shape).to(y.dtype)
    return out if bias is None else out + bias.reshape(shape)


# ---------------------------------------------------------------- training flags

def _flag_position(node: fx.Node) -> tuple[int, str] | None:
    """(position, name) of a call's ``training``/``train`` argument, read from its ATen
    schema or Python signature (BatchNorm, dropout...); None if it has none."""
    if node.op != "call_function":
        return None
    if isinstance(node.target, torch._ops.OpOverload):
        names = [a.name for a in node.target._schema.arguments]
    else:
        try:
            names = list(inspect.signature(node.target).parameters)
        except (TypeError, ValueError):
            return None
    for i, name in enumerate(names):
        if name in ("training", "train"):
            return i, name
    return None


def _flag(node: fx.Node) -> bool | None:
    where = _flag_position(node)
    if where is None:
        return None
    i, name = where
    value = node.args[i] if i < len(node.args) else node.kwargs.get(name)
    return value if isinstance(value, bool) else None


def _set_flag(node: fx.Node, value: bool) -> bool:
    """Set a literal training flag; whether it changed."""
    if _flag(node) in (None, value):
        return False
    i, name = _flag_position(node)
    if i < len(node.args):
        node.update_arg(i, value)
    else:
        node.update_kwarg(name, value)
    return True


def _set_increment(counter: fx.Node, value: int) -> bool:
    """``num_batches_tracked.add_(value)``: 1 counts a batch, 0 does not; whether it changed."""
    if counter.args[1] == value:
        return False
    counter.update_arg(1, value)
    return True


def _eval_mode_parts(gm: fx.GraphModule) -> list[str]:
    """What says ``gm`` was captured for inference: its module is in eval mode (torch level),
    or every op with a training flag has it off (ATen level, where the mode is baked into
    the graph; one BatchNorm kept in eval on purpose among training ones is fine)."""
    if not gm.training:
        return ["the module (its .training is False)"]
    flagged = [(n, _flag(n)) for n in gm.graph.nodes if _flag(n) is not None]
    flagged += [(n, False) for n in gm.graph.nodes if "no_training" in str(n.target)]
    if flagged and not any(value for _, value in flagged):
        return [f"node {n.name!r} ({n.target} with training off)" for n, _ in flagged]
    return []


# ---------------------------------------------------------------- the prepare pass

def _functionalize(gm: fx.GraphModule, node: fx.Node) -> None:
    """Turn a call of an ``nn.Linear``/``nn.ConvNd`` into ``F.linear``/``F.convNd`` on its
    parameters, in place (the node keeps its name, so reports still match)."""
    mod = gm.get_submodule(node.target)
    with gm.graph.inserting_before(node):
        weight = gm.graph.get_attr(f"{node.target}.weight")
        bias = gm.graph.get_attr(f"{node.target}.bias") if mod.bias is not None else None
    if isinstance(mod, nn.Linear):
        target, args = F.linear, (node.args[0], weight, bias)
    else:
        target = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[mod.weight.dim() - 2]
        args = (node.args[0], weight, bias, mod.stride, mod.padding, mod.dilation, mod.groups)
    node.op, node.target, node.args, node.kwargs = "call_function", target, args, {}


def _value(gm: fx.GraphModule, arg: Any) -> Any:
    """The tensor a get_attr node or module ParamRef stands for (None stays None)."""
    if isinstance(arg, ParamRef):
        return fetch_attr(gm, arg.target)
    if isinstance(arg, fx.Node):
        return fetch_attr(gm, arg.target)
    return arg


def _following_bn(gm: fx.GraphModule, site: Site) -> Any:
    """The canonical train-mode BatchNorm that is the only user of a conv site, with
    constant parameters and running statistics; None otherwise."""
    users = list(site.node.users)
    if len(users) != 1:
        return None
    canon = canonicalize(users[0])
    if canon is None or canon.op != "batch_norm" or canon.interior or canon.args[0] is not site.node:
        return None
    _, gamma, beta, mean, var, training, _, _ = canon.args
    constant = all(a is None or isinstance(a, ParamRef) or isinstance(a, fx.Node) and a.op == "get_attr"
                   for a in (gamma, beta, mean, var))
    return canon if training is True and constant and var is not None and mean is not None else None


class PrepareQAT(Pass):
    """Insert fake quantization where ``quantize`` will quantize, and fold conv + BatchNorm
    for training (see :mod:`fxopt.quant.qat`; use :func:`fxopt.quant.prepare_qat`).

    Not registered by name: its result is only meaningful inside a :class:`QATModel`
    (the schedule, the BatchNorm modes), and it is not an equivalence-preserving pass."""

    name = "prepare_qat"
    options = {
        **SELECTION_OPTIONS,
        "mode": Option(str, "int8_static", "what convert_qat lowers to: int8 weights and "
                       "activations (static or dynamic), int8 or int4 weights only",
                       choices=SELECTION_OPTIONS["mode"].choices),
        "per_channel": Option(bool, True, "int8 weights: one scale per output channel (else per tensor)"),
        "group_size": Quantize.options["group_size"],
        "symmetric": Option(bool, False, "int8_static activations: symmetric range (zero point 0)"),
        "symmetric_weights": Option(bool, True, "weights are symmetric (the int8/int4 lowering "
                                                "has no weight zero point)"),
        "learnable": Option(bool, False, "scales are trained (LSQ) once observers freeze"),
        "averaging_constant": Option(float, 0.01, "activation range: moving-average constant"),
        "fold_bn": Option(bool, True, "fold BatchNorm into the preceding convolution's fake quantization"),
    }
    requires = ("shapes",)

    def __init__(self, **options: Any):
        super().__init__(**options)
        if not self.options["symmetric_weights"]:
            raise PassOptionError(self.name, "symmetric_weights",
                                  "asymmetric weights are not supported: the int8 and int4 lowerings "
                                  "store weights without a zero point; use symmetric_weights=True")

    def run(self, gm: fx.GraphModule, ctx: Any) -> PassResult:
        planned = plan(gm, self.options)
        if message := nothing_quantized(self.name, planned):
            raise InputError(message)
        for site, mode, _ in planned:
            if mode and site.node.op == "call_module":
                _functionalize(gm, site.node)
        self.weight_fqs: dict[tuple, fx.Node] = {}
        self.act_fqs: dict[tuple, fx.Node] = {}
        folds = []
        for site, mode, _ in plan(gm, self.options):  # every quantized site reads a get_attr now
            if mode is None:
                continue
            bn = _following_bn(gm, site) if self.options["fold_bn"] and site.spelling.kind == "conv" else None
            if bn is not None:
                folds.append(self._fold(gm, site, bn))
            else:
                self._fake_quant_weight(gm, site, mode)
            if mode in ("int8_static", "int8_dynamic"):
                self._fake_quant_activation(gm, site, mode)
        gm.meta[FOLDS_KEY] = folds
        return PassResult(True, {"sites": len([1 for _, m, _ in planned if m]), "folded_bn": len(folds),
                                 "activation_fake_quants": len(self.act_fqs)})

    def _weight_module(self, weight: torch.Tensor, site: Site, mode: str) -> WeightFakeQuant:
        int4 = mode == "int4_weight_only"
        granularity = "group" if int4 else "channel" if self.options["per_channel"] else "tensor"
        group = site_group_size(site, self.options)[0] if int4 else 0
        return WeightFakeQuant(weight, site.stored_contracted(), 4 if int4 else 8, granularity,
                               group, self.options["learnable"])

    def _add(self, gm: fx.GraphModule, base: str, module: nn.Module, arg: fx.Node) -> fx.Node:
        name = fresh_attr_name(gm, base)
        gm.add_submodule(name, module)
        with gm.graph.inserting_after(arg):
            node = gm.graph.call_module(name, (arg,))
        node.meta.update({k: v for k, v in arg.meta.items() if k in ("val", "tensor_meta")})
        return node

    def _fake_quant_weight(self, gm: fx.GraphModule, site: Site, mode: str) -> None:
        key = (site.weight_key, site.stored_contracted(), mode == "int4_weight_only")
        if key not in self.weight_fqs:
            module = self._weight_module(site.weight, site, mode)
            self.weight_fqs[key] = self._add(gm, f"{site.weight_key}_fake_quant", module, site.weight_root)
        first = site.weight_path[0] if site.weight_path else site.node
        first.replace_input_with(site.weight_root, self.weight_fqs[key])

    def _fake_quant_activation(self, gm: fx.GraphModule, site: Site, mode: str) -> None:
        per_token = site.spelling.linear_like
        key = (site.act, mode, per_token)
        if key not in self.act_fqs:
            if mode == "int8_static":
                module = ActivationFakeQuant(self.options["symmetric"], self.options["averaging_constant"],
                                             self.options["learnable"])
            else:
                module = DynamicFakeQuant(per_token)
            self.act_fqs[key] = self._add(gm, f"{site.act.name}_fake_quant", module, site.act)
        site.node.replace_input_with(site.act, self.act_fqs[key])

    def _fold(self, gm: fx.GraphModule, site: Site, bn: Any) -> Fold:
        """conv(x, fq(w * f), None) / f + bias, then the BatchNorm; f = gamma / sqrt(var + eps)."""
        _, gamma, _, _, var, _, _, eps = bn.args
        bn_node = next(iter(site.node.users))
        graph = gm.graph
        with graph.inserting_before(site.node):
            gamma_n, var_n = (graph.get_attr(a.target) if isinstance(a, ParamRef) else a for a in (gamma, var))
            folded = graph.call_function(fold_weight, (site.weight_root, gamma_n, var_n, eps, 0))
        init = fold_weight(site.weight, _value(gm, gamma), _value(gm, var), eps, 0)
        fq = self._add(gm, f"{site.weight_key}_fake_quant", self._weight_module(init, site, "int8"), folded)
        bias = site.node.args[2] if len(site.node.args) > 2 else site.node.kwargs.get("bias")
        site.node.replace_input_with(site.weight_root, fq)
        if len(site.node.args) > 2:
            site.node.update_arg(2, None)
        else:
            site.node.update_kwarg("bias", None)
        with graph.inserting_after(site.node):
            unscale = graph.call_function(unscale_conv, (site.node, gamma_n, var_n, eps, bias))
        unscale.meta.update({k: v for k, v in site.node.meta.items() if k in ("val", "tensor_meta")})
        bn_node.replace_input_with(site.node, unscale)
        return Fold(site.node.name, bn_node.name, unscale.name)


# ---------------------------------------------------------------- the trainable module

_FAKE_QUANTS = (WeightFakeQuant, ActivationFakeQuant, DynamicFakeQuant)

class QATModel(nn.Module):
    """A model prepared for quantization-aware training: train it like the original.

    ``forward`` in training mode counts a step; after ``freeze_observers_after`` steps the
    observed ranges freeze (learnable scales start learning), after ``freeze_bn_after``
    steps the folded BatchNorms stop updating their statistics and use them. Both can also
    be done by hand: :meth:`freeze_observers`, :meth:`freeze_bn`. The schedule's state is
    part of ``state_dict``. The graph is ``self.gm``.
    """

    def __init__(self, gm: fx.GraphModule, options: dict[str, Any], example_inputs: Sequence[Any],
                 freeze_observers_after: int | None, freeze_bn_after: int | None):
        super().__init__()
        self.gm = gm
        self.options = dict(options)
        self.example_inputs = tuple(example_inputs)
        self.folds: list[Fold] = gm.meta.pop(FOLDS_KEY, [])
        #: ops whose training flag follows this module's mode (those captured in training)
        self.mode_nodes = {n.name for n in gm.graph.nodes if _flag(n) is True}
        #: BatchNorm node -> the nodes counting its batches (ATen graphs): they count only
        #: while the BatchNorm updates its statistics, as an eager BatchNorm does
        self.counters = {n.name: [c.name for c in _counter_updates(n) if c.args[1:] == (1,)]
                         for n in gm.graph.nodes if n.name in self.mode_nodes}
        self.freeze_observers_after, self.freeze_bn_after = freeze_observers_after, freeze_bn_after
        self.steps = 0
        self.observers_frozen = self.bn_frozen = False
        self.train(gm.training)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training:
            _outside_compiled_graphs(self._step)
        return self.gm(*args, **kwargs)

    def _step(self) -> None:
        """Bookkeeping outside any compiled graph (a Python counter must not be guarded on)."""
        if not self.observers_frozen and self.freeze_observers_after is not None \
                and self.steps >= self.freeze_observers_after:
            self.freeze_observers()
        if not self.bn_frozen and self.freeze_bn_after is not None and self.steps >= self.freeze_bn_after:
            self.freeze_bn()
        self.steps += 1

    def fake_quants(self) -> list[nn.Module]:
        return [m for m in self.gm.modules() if isinstance(m, _FAKE_QUANTS)]

    def float_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained float parameters and buffers under the prepared model's names: load
        them into it for the float reference of ``accuracy_report``."""
        fake = {name for name, m in self.gm.named_modules() if isinstance(m, _FAKE_QUANTS)}
        return {k: v for k, v in self.gm.state_dict().items() if k.rpartition(".")[0] not in fake}

    def freeze_observers(self) -> None:
        """Stop updating observed ranges (learnable scales train from here on)."""
        for module in self.fake_quants():
            if hasattr(module, "observing"):
                module.observing = False
        self.observers_frozen = True

    def freeze_bn(self) -> None:
        """Folded BatchNorms stop updating running statistics and use them, in training too."""
        self.bn_frozen = True
        self._apply_mode()

    def train(self, mode: bool = True) -> QATModel:
        super().train(mode)
        self._apply_mode()
        return self

    def _apply_mode(self) -> None:
        """Put the graph's BatchNorm and dropout in this module's mode (ATen graphs carry it
        as an argument), and the frozen BatchNorms in eval mode."""
        frozen = {f.bn for f in self.folds} if self.bn_frozen else set()
        nodes = {n.name: n for n in self.gm.graph.nodes}
        changed = False
        for node in self.gm.graph.nodes:
            if node.op == "call_module" and node.name in frozen:
                self.gm.get_submodule(node.target).train(False)
            elif node.name in self.mode_nodes:
                updating = self.training and node.name not in frozen
                changed |= _set_flag(node, updating)
                for counter in self.counters.get(node.name, ()):
                    changed |= _set_increment(nodes[counter], int(updating))
        if changed:
            self.gm.recompile()

    def get_extra_state(self) -> dict[str, Any]:
        return {"steps": self.steps, "observers_frozen": self.observers_frozen, "bn_frozen": self.bn_frozen}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.steps = state["steps"]
        if state["observers_frozen"]:
            self.freeze_observers()
        if state["bn_frozen"]:
            self.freeze_bn()


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A deep copy with its own parameters and buffers; the fake tensors of node metadata
    (shape information, read-only) are shared rather than copied."""
    memo = {id(v): v for n in gm.graph.nodes for k in ("val", "example_value")
            for v in torch.utils._pytree.tree_leaves(n.meta.get(k)) if isinstance(v, torch.Tensor)}
    return copy.deepcopy(gm, memo)


def _capture(model: Any) -> fx.GraphModule:
    """A GraphModule of ``model`` with its own copy of every tensor (training must not
    write into the user's float model)."""
    if not isinstance(model, (nn.Module, torch.export.ExportedProgram)):
        raise InputError(f"prepare_qat takes an nn.Module, GraphModule or torch.export "
                         f"ExportedProgram in training mode, got {type(model).__name__}")
    gm = _copy(as_graph_module(model))
    parts = _eval_mode_parts(gm)
    if parts:
        raise InputError("prepare_qat: the model is in eval mode or was captured for inference: "
                         + ", ".join(parts[:3]) + "; quantization-aware training needs a training "
                         "graph: call model.train() before symbolic_trace or torch.export.export")
    return gm


def prepare_qat(model: nn.Module | fx.GraphModule | torch.export.ExportedProgram,
                example_inputs: Sequence[Any], mode: str = "int8_static", *,
                freeze_observers_after: int | None = None, freeze_bn_after: int | None = None,
                **options: Any) -> QATModel:
    """Prepare ``model`` (in training mode) for quantization-aware training.

    ``model``: an ``nn.Module`` (traced with ``symbolic_trace``), a GraphModule, or a
    ``torch.export`` training graph (an ``ExportedProgram`` of a train-mode model). It is
    left untouched: the result trains copies of its parameters. ``mode`` is what
    :func:`convert_qat` will lower to (``int8_static``, ``int8_dynamic``,
    ``int8_weight_only``, ``int4_weight_only``); ``options`` are :class:`PrepareQAT`'s
    (``per_channel``, ``group_size``, ``symmetric``, ``learnable``, ``fold_bn``, ``skip``,
    ``keep_first_last``, ``overrides``...). Errors: an eval-mode model or graph, no
    quantizable site (:class:`fxopt.FxoptError` subclasses naming what is wrong), an
    unknown option or unsupported combination (``PassOptionError``).
    """
    pass_ = PrepareQAT(mode=mode, **options)
    gm = _capture(model)
    PassManager([pass_]).run(gm, example_inputs, training=True)
    return QATModel(gm, pass_.options, example_inputs, freeze_observers_after, freeze_bn_after)


# ---------------------------------------------------------------- convert

def _lower_fold(gm: fx.GraphModule, fold: Fold, scales: dict[tuple, torch.Tensor]) -> None:
    """Replace conv -> unscale -> BatchNorm by one convolution with the folded weight and
    bias (eval-mode folding, from the running statistics), named as the BatchNorm was."""
    nodes = {n.name: n for n in gm.graph.nodes}
    conv, bn, unscale = nodes[fold.conv], nodes[fold.bn], nodes[fold.unscale]
    _, gamma, beta, mean, var, _, _, eps = canonicalize(bn).args
    fq_node = conv.args[1]
    fq: WeightFakeQuant = gm.get_submodule(fq_node.target)
    folded_node = fq_node.args[0]
    w = fetch_attr(gm, folded_node.args[0].target)
    gamma, beta, mean, var = (_value(gm, a) for a in (gamma, beta, mean, var))
    bias = _value(gm, unscale.args[4])
    weight = fold_weight(w, gamma, var, eps, 0).detach()
    new_bias = fold_bias(bias, gamma, beta, mean, var, eps, w).detach()
    names = []
    for suffix, value in (("folded_weight", weight), ("folded_bias", new_bias)):
        names.append(fresh_attr_name(gm, f"{fold.conv}_{suffix}"))
        gm.register_buffer(names[-1], value)
    scales[(id(weight), fq.contracted, False)] = fq.lowering_scale()
    with gm.graph.inserting_before(bn):
        w_node, b_node = gm.graph.get_attr(names[0]), gm.graph.get_attr(names[1])
    counters = _counter_updates(bn)
    bn.op, bn.target, bn.kwargs = conv.op, conv.target, {}
    bn.args = (conv.args[0], w_node, b_node, *conv.args[3:])
    for node in (unscale, conv, fq_node, folded_node, *counters):
        gm.graph.erase_node(node)


def _counter_updates(bn: fx.Node) -> list[fx.Node]:
    """The nodes that count a functional BatchNorm's batches (``num_batches_tracked.add_(1)``,
    separate from the BatchNorm in ATen training graphs); unused writes of that buffer."""
    canon = canonicalize(bn)
    prefix = _owner(bn) if canon is not None and canon.op == "batch_norm" else None
    if prefix is None:
        return []
    return [user for n in bn.graph.nodes
            if n.op == "get_attr" and n.target == f"{prefix}num_batches_tracked"
            for user in n.users if n in mutated_inputs(user) and not user.users]


def _owner(bn: fx.Node) -> str | None:
    """The attribute prefix (``"bn."``) of a functional BatchNorm's buffers."""
    canon = canonicalize(bn)
    mean = canon.args[3]
    if isinstance(mean, fx.Node) and mean.op == "get_attr":
        return mean.target.rpartition(".")[0] + "." if "." in mean.target else ""
    return None


def _strip_fake_quants(gm: fx.GraphModule, scales: dict[tuple, torch.Tensor]) -> None:
    """Remove weight and dynamic fake quantization, recording each weight's scale."""
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if isinstance(module, WeightFakeQuant):
            weight = fetch_attr(gm, node.args[0].target)
            scales[(id(weight), module.contracted, module.bits == 4)] = module.lowering_scale()
        elif not isinstance(module, DynamicFakeQuant):
            continue
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)


def convert_qat(qat: QATModel, example_inputs: Sequence[Any] | None = None) -> fx.GraphModule:
    """The quantized GraphModule of a trained :class:`QATModel`: BatchNorms folded, the
    trained scales used, lowered by the ``quantize`` pass exactly as post-training
    quantization lowers (``fxopt.quant.summary_of`` and ``accuracy_report`` work on it).

    ``qat`` is left as it is (training may go on). ``example_inputs`` default to the ones
    given to ``prepare_qat``. Warns if no training step ran (the activation ranges were
    never observed).
    """
    if not isinstance(qat, QATModel):
        raise InputError(f"convert_qat takes the QATModel prepare_qat returned, got {type(qat).__name__}")
    if qat.steps == 0:
        warnings.warn("convert_qat: no training step ran, so the observers never saw data: activation "
                      "ranges are placeholders and weight scales the initial ones; train first",
                      stacklevel=2)
    gm = _copy(qat.gm)
    scales: dict[tuple, torch.Tensor] = {}
    for fold in qat.folds:
        _lower_fold(gm, fold, scales)
    _strip_fake_quants(gm, scales)
    gm.eval()
    for node in gm.graph.nodes:
        _set_flag(node, False)
    gm.recompile()
    options = {k: v for k, v in qat.options.items() if k in Quantize.options}
    PassManager([Quantize(weight_scales=scales, **options)]).run(
        gm, example_inputs or qat.example_inputs, training=False)
    return gm


_RUN_EAGERLY: Callable[[Callable[[], None]], None] | None = None


def _outside_compiled_graphs(fn: Callable[[], None]) -> None:
    """Call ``fn`` where Dynamo does not trace (a Python counter must not be guarded on).
    ``torch.compiler.disable`` is applied at the first call, not as a decorator: applied at
    import, it imported ``torch._dynamo`` and Inductor with every pass lookup."""
    global _RUN_EAGERLY
    if _RUN_EAGERLY is None:
        _RUN_EAGERLY = torch.compiler.disable(lambda step: step())
    _RUN_EAGERLY(fn)
