"""Op semantics that soundness depends on: which nodes mutate, draw random numbers or
have other side effects.

This works at both levels a user meets. ATen ops (``OpOverload``) answer from their
schema (alias annotations, ``nondeterministic_seeded`` tag); torch-level spellings
(``x.add_()``, ``operator.iadd``, ``F.relu(inplace=True)``, ``nn.ReLU(inplace=True)``,
``torch.rand``) answer from naming conventions and a few tables. When in doubt an op is
reported as effectful: a pass that keeps a node it could have removed loses a little
speed, one that removes a needed node computes the wrong function.
"""

from __future__ import annotations

import builtins
import operator
from functools import cache

import torch
import torch.fx as fx
import torch.nn as nn

_INPLACE_OPERATORS = frozenset(
    getattr(operator, name)
    for name in (
        "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul",
        "iand", "ior", "ixor", "ilshift", "irshift",
    )
)

_SIDE_EFFECT_CALLABLES = frozenset(
    {builtins.print, operator.setitem, operator.delitem, torch._assert}
    | set(getattr(fx.node, "_side_effectful_functions", ()))
)

#: module types whose call is pure in eval mode and whose only effect-relevant state is
#: an ``inplace`` flag; anything else (user leaf modules) is opaque and kept by DCE
_RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                   nn.FeatureAlphaDropout, nn.RReLU)
_STATEFUL_IN_TRAINING = (nn.modules.batchnorm._NormBase,)

_RANDOM_FUNCTION_NAMES = frozenset({
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
    "bernoulli", "multinomial", "normal", "poisson", "dropout", "alpha_dropout",
    "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d", "rrelu",
    "gumbel_softmax", "native_dropout", "uniform", "exponential", "geometric",
    "cauchy", "log_normal", "random",
})
# functional dropouts are random only when their `training` flag is true
_TRAINING_FLAG_POSITION = {
    "dropout": 2, "alpha_dropout": 2, "feature_alpha_dropout": 2,
    "dropout1d": 2, "dropout2d": 2, "dropout3d": 2, "rrelu": 3,
}


def _target_name(target: object) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", "")


@cache
def _schema_writes(target: torch._ops.OpOverload) -> tuple[int, ...]:
    """Positions of the arguments an ATen overload writes to (its alias annotations)."""
    return tuple(
        i for i, arg in enumerate(target._schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    )


def _module(node: fx.Node) -> nn.Module | None:
    owner = node.graph.owning_module
    if node.op != "call_module" or owner is None:
        return None
    try:
        return owner.get_submodule(node.target)
    except AttributeError:
        return None


def mutated_inputs(node: fx.Node) -> list[fx.Node]:
    """The input nodes whose tensors ``node`` writes to in place (empty if none)."""
    written: list[object] = []
    target = node.target
    if node.op == "call_function":
        if isinstance(target, torch._ops.OpOverload):
            positions = _schema_writes(target)
            schema_args = target._schema.arguments
            for i in positions:
                if i < len(node.args):
                    written.append(node.args[i])
                elif schema_args[i].name in node.kwargs:
                    written.append(node.kwargs[schema_args[i].name])
        elif target in _INPLACE_OPERATORS or target in (operator.setitem, operator.delitem):
            written.append(node.args[0])
        elif _is_inplace_name(_target_name(target)) or node.kwargs.get("inplace") is True:
            written.append(node.args[0] if node.args else node.kwargs.get("input"))
    elif node.op == "call_method":
        if _is_inplace_name(target):
            written.append(node.args[0])
    elif node.op == "call_module":
        mod = _module(node)
        if mod is not None and getattr(mod, "inplace", False) is True:
            written.append(node.args[0] if node.args else None)
    if "out" in node.kwargs:
        written.append(node.kwargs["out"])
    result: list[fx.Node] = []
    for item in written:
        for leaf in torch.utils._pytree.tree_leaves(item):
            if isinstance(leaf, fx.Node) and leaf not in result:
                result.append(leaf)
    return result


def _is_inplace_name(name: object) -> bool:
    return (
        isinstance(name, str) and name.endswith("_") and not name.startswith("__")
        and name not in ("_", )
    )


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` draws from the random number generator when it runs."""
    target = node.target
    if node.op == "call_module":
        mod = _module(node)
        return isinstance(mod, _RANDOM_MODULES) and mod.training
    if node.op not in ("call_function", "call_method"):
        return False
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags and not _training_off(node, target)
    name = _target_name(target).rstrip("_")
    if name not in _RANDOM_FUNCTION_NAMES:
        return False
    return not _functional_training_off(node, name)


def _training_off(node: fx.Node, target: torch._ops.OpOverload) -> bool:
    """aten.dropout(x, p, train=False) is tagged random but is the identity."""
    for i, arg in enumerate(target._schema.arguments):
        if arg.name in ("train", "training"):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            return value is False
    return False


def _functional_training_off(node: fx.Node, name: str) -> bool:
    position = _TRAINING_FLAG_POSITION.get(name)
    if position is None:
        return False
    if "training" in node.kwargs:
        return node.kwargs["training"] is False
    if len(node.args) > position:
        return node.args[position] is False
    return False  # F.dropout defaults to training=True


def has_side_effects(node: fx.Node) -> bool:
    """Whether running ``node`` does something beyond producing its value.

    That covers in-place writes, RNG draws, asserts and printing, updates of module state
    (BatchNorm running statistics in training mode) and calls of opaque user modules.
    """
    if node.op in ("placeholder", "output"):
        return True
    if node.op == "get_attr":
        return False
    if mutated_inputs(node) or is_random(node):
        return True
    target = node.target
    if node.op == "call_module":
        mod = _module(node)
        if mod is None or not _is_torch_nn_module(mod):
            return True  # a user's leaf module may do anything
        return isinstance(mod, _STATEFUL_IN_TRAINING) and mod.training and bool(
            getattr(mod, "track_running_stats", False)
        )
    if node.op == "call_method":
        return target in ("backward", "register_hook", "retain_grad", "record_stream")
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable or target in _SIDE_EFFECT_CALLABLES
    try:
        return target in _SIDE_EFFECT_CALLABLES
    except TypeError:  # unhashable callable
        return True


def _is_torch_nn_module(mod: nn.Module) -> bool:
    return type(mod).__module__.startswith("torch.nn.") and not isinstance(mod, fx.GraphModule)


def is_pure(node: fx.Node) -> bool:
    """A node whose result depends only on its inputs and which has no effects.

    Pure nodes may be removed when unused (DCE), merged with an identical twin (CSE) and
    evaluated ahead of time when their inputs are constants (constant folding).
    """
    return node.op in ("call_function", "call_method", "call_module", "get_attr") and not (
        has_side_effects(node)
    )
