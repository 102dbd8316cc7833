"""The op-facts model: the one place that says what an op does.

Every pass (dce, cse, constant_fold, inplace, plan_memory, the pattern matcher, the
fusions, quantization) asks this module, and none keeps a table of its own. For any node,
at torch level (``symbolic_trace``, Dynamo) or ATen level (export, ``make_fx``),
:func:`facts` answers: which inputs it writes, whether it draws random numbers, updates
state (training-mode batch norm running statistics), is a collective, may return an alias
of an input, or is simply *unknown*.

Where the answers come from, in order:

1. facts the user declared with :func:`declare_op` (fxopt's own custom ops are declared the
   same way);
2. torch's own facts where they are trustworthy: schema alias annotations (``Tensor(a!)``
   writes, ``Tensor(a)`` returns), the ``nondeterministic_seeded`` tag and registered
   effects (``_get_effect``); a torch-level callable (``torch.relu``, ``F.gelu``,
   ``x.add_()``, ``operator.add``) is identified by *identity* with the object torch
   exports under that name, then answered from the ATen op of the same name;
3. one table of corrections where torch's answers are wrong (``_Correction``): batch norm
   and instance norm write their running statistics in training, ``F.embedding`` with
   ``max_norm`` renormalizes its weight in place, functional collectives are ordered
   effects, ``wait_tensor`` returns its input's storage, dropout-like ops are random only
   when their training flag is on (see ``shared/reference/op-facts.md``).

Everything else is **unknown, and unknown is effectful**: an ``fx.wrap``'d function, a
lambda, a custom op nobody declared (``torch.library.custom_op(mutates_args=())`` says
nothing about randomness or printing), an ``OpOverloadPacket`` whose overloads disagree,
a higher-order op, a user's leaf module, a module with hooks. A pass that keeps a node it
could have removed loses a little speed; one that removes or merges a needed node computes
the wrong function.
"""

from __future__ import annotations

import builtins
import inspect
import operator
import re
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

__all__ = [
    "NodeFacts", "OpFacts", "declare_op", "facts", "functional_form", "has_side_effects",
    "inplace_name", "is_collective", "is_commutative", "is_inplace_name", "is_pure", "is_random",
    "may_spell_inplace", "mutated_inputs", "op_name", "output_aliases", "signature_of", "spelled_inplace",
    "torch_name", "unseen_aliases",
]


# ---------------------------------------------------------------------------------------
# the facts
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpFacts:
    """What an op does, independent of one call: the form users declare facts in.

    ``writes`` and ``aliases`` name arguments by position (int) or name (str).
    """

    #: nothing beyond computing its result from its inputs (then the rest must be empty)
    pure: bool = False
    writes: tuple[int | str, ...] = ()
    random: bool = False
    collective: bool = False
    #: arguments whose storage the result may share
    aliases: tuple[int | str, ...] = ()
    #: updates state that outlives the call and is no argument of it (a module's own
    #: buffers: an observer's range)
    stateful: bool = False

    def __post_init__(self) -> None:
        if self.pure and (self.writes or self.random or self.collective or self.stateful):
            raise ValueError("an op declared pure cannot also write, draw random numbers, "
                             "update state or be a collective")


@dataclass(frozen=True)
class NodeFacts:
    """What one node does when it runs."""

    #: input nodes whose tensors it writes in place
    writes: tuple[fx.Node, ...] = ()
    random: bool = False
    #: updates state that outlives the call (training-mode batch norm running statistics)
    stateful: bool = False
    #: a collective: every rank must issue the same ones, in the same order
    collective: bool = False
    #: input nodes whose storage its result may share (beyond what FakeTensor shows)
    aliases: tuple[fx.Node, ...] = ()
    #: not known to be pure: treated as having any effect
    unknown: bool = False
    #: why it is effectful (for reports and error messages); empty when pure
    reason: str = ""

    @property
    def pure(self) -> bool:
        """Removable when unused, mergeable with an identical twin, foldable ahead of time."""
        return not (self.writes or self.random or self.stateful or self.collective or self.unknown)


_PURE = NodeFacts()


def _unknown(reason: str) -> NodeFacts:
    return NodeFacts(unknown=True, reason=reason)


# ---------------------------------------------------------------------------------------
# declarations (users' and fxopt's own custom ops)
# ---------------------------------------------------------------------------------------

_DECLARED: dict[Any, OpFacts] = {}


def declare_op(target: Any = None, *, pure: bool = False, writes: Sequence[int | str] = (),
               random: bool = False, collective: bool = False,
               aliases: Sequence[int | str] = (), stateful: bool = False) -> Any:
    """Tell fxopt what a function, custom op or module type does.

    Without a declaration fxopt treats such a call as effectful: it is never removed,
    merged, folded, moved across or written into. Declare ``pure=True`` to let the passes
    optimize around it::

        @fxopt.declare_op(pure=True)
        def scaled(x, s):
            return x * s

        torch.fx.wrap("scaled")  # keep it as one node when tracing

    ``stateful=True``: it updates state of its own that is no argument of the call (a
    module's buffers, as an observer's range): never removed, merged or moved, but not
    otherwise unknown.

    ``target`` may be a Python callable, an ``OpOverload``, an ``OpOverloadPacket`` (all
    overloads), a qualified op name (``"mylib::op"``) or an ``nn.Module`` subclass. Used
    without ``target`` it is a decorator. Returns ``target``.
    """
    op_facts = OpFacts(pure=pure, writes=tuple(writes), random=random, collective=collective,
                       aliases=tuple(aliases), stateful=stateful)

    def register(obj: Any) -> Any:
        key = _declaration_key(obj)
        if key is None:
            raise TypeError(f"declare_op: cannot declare facts for {obj!r}: pass a function, "
                            "an OpOverload or OpOverloadPacket, 'namespace::op', or an "
                            "nn.Module subclass")
        _DECLARED[key] = op_facts
        return obj

    return register if target is None else register(target)


def _declaration_key(obj: Any) -> Any:
    if isinstance(obj, torch._ops.OpOverload):
        return obj
    if isinstance(obj, torch._ops.OpOverloadPacket):
        return obj._qualified_op_name
    if isinstance(obj, str):
        return obj if "::" in obj else None
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        return obj
    if callable(obj):
        try:
            hash(obj)
        except TypeError:
            return None
        return obj
    return None


def _declared(target: Any) -> OpFacts | None:
    try:
        found = _DECLARED.get(target)
    except TypeError:
        return None
    if found is None and isinstance(target, torch._ops.OpOverload):
        found = _DECLARED.get(target._schema.name)
    return found


# ---------------------------------------------------------------------------------------
# naming
# ---------------------------------------------------------------------------------------


def is_inplace_name(name: object) -> bool:
    """``relu_``, ``add_``: torch's convention for an op that writes its first argument
    (dunder names and a lone ``_`` excluded)."""
    return isinstance(name, str) and len(name) > 1 and name.endswith("_") and not name.endswith("__")


def inplace_name(name: str) -> str:
    """The in-place spelling of an op name (``relu`` -> ``relu_``)."""
    return name if is_inplace_name(name) else name + "_"


def base_name(name: str) -> str:
    """The out-of-place spelling of an op name (``relu_`` -> ``relu``)."""
    return name[:-1] if is_inplace_name(name) else name


#: ops whose two tensor operands may be swapped (when the remaining arguments are equal)
_COMMUTATIVE = frozenset({"add", "mul", "maximum", "minimum", "eq", "ne", "bitwise_and",
                          "bitwise_or", "bitwise_xor", "logical_and", "logical_or"})


def is_commutative(name: str) -> bool:
    """Whether the op called ``name`` (canonical, out-of-place) is symmetric in its two
    tensor operands."""
    return base_name(name) in _COMMUTATIVE


_TORCH_NAMESPACES: tuple[types.ModuleType, ...] = (
    torch, F, torch._C._nn, torch.special, torch.linalg, torch.fft, torch._C._VariableFunctions,
)


@cache
def _torch_callables() -> dict[int, tuple[Any, str]]:
    """id(callable) -> (callable, name) for everything torch exports under a public name."""
    index: dict[int, tuple[Any, str]] = {}
    for namespace in _TORCH_NAMESPACES:
        # public names first: F.threshold is also F._threshold, and "threshold" is its name
        for name in sorted(dir(namespace), key=lambda n: n.startswith("_")):
            if name.startswith("__"):
                continue
            obj = getattr(namespace, name, None)
            if callable(obj) and not isinstance(obj, type) and id(obj) not in index:
                index[id(obj)] = (obj, name)
    for name in dir(torch.Tensor):
        obj = getattr(torch.Tensor, name, None)
        if callable(obj) and id(obj) not in index and not name.startswith("__"):
            index[id(obj)] = (obj, name)
    return index


def torch_name(target: Any) -> str | None:
    """The name torch exports ``target`` under (``torch.relu`` -> ``"relu"``,
    ``F.gelu`` -> ``"gelu"``), or None for anything that is not torch's own callable.

    Identity, not ``__name__``: a user's function called ``relu`` is not ``torch.relu``.
    """
    entry = _torch_callables().get(id(target))
    return entry[1] if entry is not None and entry[0] is target else None


# ---------------------------------------------------------------------------------------
# spellings: every way of calling an op, read back as one name
# ---------------------------------------------------------------------------------------

#: Python operators spelled differently from their ATen op
_OPERATOR_NAMES = {"truediv": "div", "floordiv": "floor_divide", "mod": "remainder", "and_": "bitwise_and",
                   "or_": "bitwise_or", "xor": "bitwise_xor", "invert": "bitwise_not",
                   "lshift": "bitwise_left_shift", "rshift": "bitwise_right_shift", "pos": "positive"}


def _operator_name(fn: Callable) -> str | None:
    """``operator.add`` -> ``add``, ``operator.iadd`` -> ``add_``, ``operator.truediv`` -> ``div``."""
    name = fn.__name__
    if fn in _INPLACE_OPERATORS:
        return inplace_name(_OPERATOR_NAMES.get(name[1:], name[1:]))
    return _OPERATOR_NAMES.get(name, name) if fn in _PURE_OPERATORS else None


def _target_name(target: Any) -> str | None:
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    if getattr(operator, getattr(target, "__name__", ""), None) is target:
        return _operator_name(target)
    return torch_name(target)


_SIGNATURES: dict[Any, inspect.Signature | None] = {}


def signature_of(target: Any) -> inspect.Signature | None:
    """``inspect.signature(target)``, remembered (for a builtin it parses a text signature:
    too slow to repeat per node), or None where there is none."""
    try:
        return _SIGNATURES[target]
    except KeyError:
        pass
    except TypeError:  # unhashable
        return None
    try:
        found = inspect.signature(target)
    except (TypeError, ValueError):
        found = None
    _SIGNATURES[target] = found
    return found


_NAMES: dict[Any, str | None] = {}


def op_name(target: Any, *, method: bool = False) -> str | None:
    """The name of the op a call performs, as ATen spells it, whatever the spelling:
    ``torch.relu``, ``F.relu``, ``x.relu()``, ``aten.relu.default`` -> ``relu``;
    ``torch.relu_``, ``x.add_()``, ``operator.iadd`` -> ``relu_`` / ``add_``;
    ``operator.truediv`` and ``x.__truediv__()`` -> ``div``. None for anything that is not
    torch's own (a user's function called ``relu`` is not ``torch.relu``)."""
    if method:
        if not isinstance(target, str):
            return None
        fn = getattr(operator, target[2:-2], None) if target.startswith("__") else None
        return (_operator_name(fn) or target) if fn is not None else target
    try:
        return _NAMES[target]
    except KeyError:
        name = _NAMES[target] = _target_name(target)
        return name
    except TypeError:  # unhashable
        return None


def spelled_inplace(target: Any, name: str | None, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether this spelling writes its result into its first argument: an in-place name
    (``relu_``, ``+=``) or an ``inplace=True`` flag, by keyword or position."""
    return (is_inplace_name(name) or kwargs.get("inplace") is True
            or callable(target) and _positional_inplace(target, tuple(args)))


def may_spell_inplace(target: Any, name: str | None, n_args: int, keywords: Iterable[str]) -> bool:
    """Whether a call with this layout (``n_args`` positional arguments, these keyword
    names) can write in place at all: an in-place name, an ``inplace`` keyword, or enough
    positional arguments to reach the ``inplace`` parameter. When not,
    :func:`spelled_inplace` is False for every call of that layout, so a caller that works
    out each layout once (the pattern matcher's call plans) need not ask per call."""
    if is_inplace_name(name) or "inplace" in keywords:
        return True
    position = _inplace_position(target) if callable(target) else None
    return position is not None and n_args > position


def functional_form(module_type: type) -> Callable | None:
    """The functional form of a ``torch.nn`` module class, found by name (``LeakyReLU`` ->
    ``F.leaky_relu``, ``SiLU`` -> ``F.silu``, ``LogSigmoid`` -> ``F.logsigmoid``,
    ``InstanceNorm2d`` -> ``F.instance_norm``); None for other modules."""
    if not module_type.__module__.startswith("torch.nn"):
        return None
    name = module_type.__name__
    for spelling in (name, name.replace("ReLU", "Relu"), name[:-2] if name[-2:] in ("1d", "2d", "3d") else name):
        snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", spelling).lower()
        for candidate in (snake, spelling.lower()):
            fn = getattr(F, candidate, None) or getattr(torch, candidate, None)
            if callable(fn) and not isinstance(fn, type):
                return fn
    return None


# ---------------------------------------------------------------------------------------
# ATen: schemas, tags, registered effects
# ---------------------------------------------------------------------------------------

_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d", "_dtensor",
                                    "_c10d_functional_autograd"})
#: namespaces whose schemas torch itself maintains (custom ops' schemas say nothing about
#: randomness or printing, so they are unknown until declared)
_TRUSTED_NAMESPACES = frozenset({"aten", "prims", "quantized_decomposed", "quantized"})


@cache
def _overload_facts(op: torch._ops.OpOverload) -> OpFacts | None:
    """Facts of an ATen overload from torch's own metadata; None when torch cannot vouch."""
    schema = op._schema
    namespace, name = schema.name.split("::", 1)
    writes = tuple(i for i, a in enumerate(schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write)
    aliases = tuple(i for i, a in enumerate(schema.arguments)
                    if a.alias_info is not None and not a.alias_info.is_write
                    and any(r.alias_info is not None and set(r.alias_info.before_set)
                            & set(a.alias_info.before_set) for r in schema.returns))
    if namespace in _COLLECTIVE_NAMESPACES:
        # wait_tensor hands back the very buffer the collective writes (its schema says no)
        return OpFacts(writes=writes, collective=True,
                       aliases=(0,) if name == "wait_tensor" else aliases)
    if namespace not in _TRUSTED_NAMESPACES or _registered_effect(op):
        return None
    random = torch.Tag.nondeterministic_seeded in op.tags
    return OpFacts(pure=not (writes or random), writes=writes, random=random, aliases=aliases)


def _registered_effect(op: torch._ops.OpOverload) -> bool:
    try:
        from torch._higher_order_ops.effects import _get_effect
    except ImportError:  # pragma: no cover - older torch
        return False
    try:
        return _get_effect(op) is not None
    except Exception:
        return True


# out= overloads write an argument; torch 2.11 has no Tag.out (they are named out*)
_OUT_TAG = getattr(torch.Tag, "out", None)


@cache
def _aten_packet_facts(name: str) -> OpFacts | None:
    """Facts of ``aten::name`` across its overloads, ``out=`` variants aside (a call with
    ``out=`` is seen separately); None when there is no such op or overloads disagree
    in a way a call cannot resolve."""
    packet = getattr(torch.ops.aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return None
    found: list[OpFacts] = []
    for overload_name in packet.overloads():
        op = getattr(packet, overload_name)
        # torch 2.11 has no Tag.out: the schema's out arguments say it on every version
        if (_OUT_TAG in getattr(op, "tags", ()) or overload_name.startswith("out")
                or any(a.is_out for a in op._schema.arguments)):
            continue
        f = _overload_facts(op)
        if f is None:
            return None
        found.append(f)
    if not found:
        return None
    if len(set(found)) == 1:
        return found[0]
    if not any(f.writes for f in found):
        random = any(f.random for f in found)
        return OpFacts(pure=not random, random=random,
                       aliases=tuple(sorted({a for f in found for a in f.aliases})))
    return None


def _packet_facts(packet: torch._ops.OpOverloadPacket) -> OpFacts | None:
    """An ``OpOverloadPacket`` call dispatches on its arguments: its facts are known only
    when every overload has the same ones."""
    declared = _DECLARED.get(packet._qualified_op_name)
    if declared is not None:
        return declared
    facts_of = [_declared(getattr(packet, o)) or _overload_facts(getattr(packet, o))
                for o in packet.overloads()]
    if not facts_of or any(f is None for f in facts_of) or len(set(facts_of)) != 1:
        return None
    return facts_of[0]


# ---------------------------------------------------------------------------------------
# corrections: where torch's own answers are wrong for a rewriter
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Correction:
    """A fact torch does not state, applied to every spelling of the op by argument name.

    ``when`` names a flag argument (``training``): the correction applies unless that
    argument is literally False (or the op's ``off_value``).
    """

    random: bool = False
    stateful_writes: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    when: tuple[str, ...] = ()
    #: (argument, value): the correction applies only while the argument is not this value
    unless: tuple[tuple[str, Any], ...] = ()


_RUNNING_STATS = ("running_mean", "running_var")
_CORRECTIONS: dict[str, _Correction] = {
    # running statistics are written in training (no schema marks them `(a!)`)
    "batch_norm": _Correction(stateful_writes=_RUNNING_STATS, when=("training",)),
    "native_batch_norm": _Correction(stateful_writes=_RUNNING_STATS, when=("training",)),
    "_batch_norm_impl_index": _Correction(stateful_writes=_RUNNING_STATS, when=("training",)),
    "cudnn_batch_norm": _Correction(stateful_writes=_RUNNING_STATS, when=("training",)),
    "miopen_batch_norm": _Correction(stateful_writes=_RUNNING_STATS, when=("training",)),
    "instance_norm": _Correction(stateful_writes=_RUNNING_STATS, when=("use_input_stats",)),
    # F.embedding(max_norm=...) renormalizes rows of its weight in place
    "embedding": _Correction(writes=("weight",), unless=(("max_norm", None),)),
    # random only while their training flag is on, or dropout probability is non-zero
    "dropout": _Correction(random=True, when=("train", "training"), unless=(("p", 0.0),)),
    "alpha_dropout": _Correction(random=True, when=("train", "training"), unless=(("p", 0.0),)),
    "feature_dropout": _Correction(random=True, when=("train", "training"), unless=(("p", 0.0),)),
    "feature_alpha_dropout": _Correction(random=True, when=("train", "training"),
                                         unless=(("p", 0.0),)),
    "dropout1d": _Correction(random=True, when=("training",), unless=(("p", 0.0),)),
    "dropout2d": _Correction(random=True, when=("training",), unless=(("p", 0.0),)),
    "dropout3d": _Correction(random=True, when=("training",), unless=(("p", 0.0),)),
    "native_dropout": _Correction(random=True, when=("train",)),
    "rrelu": _Correction(random=True, when=("training",)),
    "rrelu_with_noise": _Correction(random=True, when=("training",)),
    "scaled_dot_product_attention": _Correction(random=True, unless=(("dropout_p", 0.0),)),
    "multi_head_attention_forward": _Correction(random=True, when=("training",),
                                                unless=(("dropout_p", 0.0),)),
    "gumbel_softmax": _Correction(random=True),
}
#: corrected ops: their random/stateful facts come from the correction alone
_CORRECTED_RANDOM = frozenset(n for n, c in _CORRECTIONS.items() if c.random)


def _applies(correction: _Correction, bound: dict[str, Any] | None) -> bool:
    """Whether the correction's condition holds for a call with these arguments (unbound
    arguments: assume it does)."""
    if bound is None:
        return True
    if any(bound.get(flag) is False for flag in correction.when):
        return False
    for name, off in correction.unless:
        # an op without that argument (aten.embedding has no max_norm) never meets it
        if name not in bound or type(bound[name]) is type(off) and bound[name] == off:
            return False
    return True


# ---------------------------------------------------------------------------------------
# binding a call's arguments to names
# ---------------------------------------------------------------------------------------


def _bind_schema(schema: Any, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    names = [a.name for a in schema.arguments]
    if len(args) > len(names) or set(kwargs) - set(names):
        return None
    bound = dict(zip(names, args))
    for a in schema.arguments[len(args):]:
        if a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        elif a.has_default_value():
            bound[a.name] = a.default_value
    return bound


def _bind(target: Any, name: str | None, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """Arguments by name: from the Python signature, else the first ATen schema of the same
    name that fits; None when neither binds."""
    if isinstance(target, torch._ops.OpOverload):
        return _bind_schema(target._schema, args, kwargs)
    signature = signature_of(target) if callable(target) else None
    if signature is not None:
        try:
            ba = signature.bind(*args, **kwargs)
            ba.apply_defaults()
            return dict(ba.arguments)
        except TypeError:
            pass
    packet = getattr(torch.ops.aten, name, None) if name else None
    if isinstance(packet, torch._ops.OpOverloadPacket):
        for overload in packet.overloads():
            bound = _bind_schema(getattr(packet, overload)._schema, args, kwargs)
            if bound is not None:
                return bound
    return None


def _positions(names: Iterable[int | str], bound: dict[str, Any] | None, args: tuple,
               kwargs: dict) -> list[Any]:
    out = []
    for n in names:
        if isinstance(n, int):
            out.append(args[n] if n < len(args) else None)
        elif bound is not None and n in bound:
            out.append(bound[n])
        else:
            out.append(kwargs.get(n))
    return out


def _nodes_in(values: Iterable[Any]) -> tuple[fx.Node, ...]:
    found: dict[fx.Node, None] = {}
    for leaf in tree_leaves(list(values)):
        if isinstance(leaf, fx.Node):
            found[leaf] = None
    return tuple(found)


# ---------------------------------------------------------------------------------------
# torch-level callables and methods without an ATen op of their name
# ---------------------------------------------------------------------------------------

_PURE_OPERATORS = frozenset(getattr(operator, n) for n in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "neg", "pos", "abs",
    "invert", "inv", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "lshift",
    "rshift", "getitem", "not_", "truth", "contains", "index", "concat", "is_", "is_not",
))
_INPLACE_OPERATORS = frozenset(getattr(operator, n) for n in (
    "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul", "iand", "ior",
    "ixor", "ilshift", "irshift", "iconcat",
))
_WRITING_OPERATORS = frozenset({operator.setitem, operator.delitem})
_PURE_BUILTINS = frozenset({builtins.getattr, builtins.len, builtins.int, builtins.float,
                            builtins.bool, builtins.min, builtins.max, builtins.abs,
                            builtins.isinstance, builtins.tuple, builtins.list, builtins.range,
                            builtins.slice, builtins.round, builtins.sum, builtins.hasattr,
                            # telemetry: records an API name once per process, touches no
                            # tensor (torchvision's StochasticDepth calls it in forward)
                            torch._C._log_api_usage_once})
#: torch-level names with no ATen op of the same name that are plain functions of their
#: inputs (checked against torch's sources: they only call pure ATen ops)
_PURE_TORCH_NAMES = frozenset({
    "interpolate", "upsample", "pad", "normalize", "softmax", "log_softmax", "softmin",
    "cross_entropy", "nll_loss", "binary_cross_entropy_with_logits", "kl_div", "linear",
    "hardtanh", "relu6", "silu", "mish", "hardswish", "hardsigmoid", "gelu", "elu", "selu",
    "celu", "leaky_relu", "softplus", "softsign", "tanhshrink", "logsigmoid", "glu",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d",
    "adaptive_max_pool2d", "adaptive_max_pool3d", "max_pool1d", "max_pool2d", "max_pool3d",
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "layer_norm", "group_norm", "rms_norm",
    "local_response_norm", "cosine_similarity", "pairwise_distance", "one_hot", "unfold",
    "fold", "pixel_shuffle", "pixel_unshuffle", "grid_sample", "affine_grid", "embedding_bag",
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
    "flatten", "unflatten", "einsum", "tensordot", "chunk", "split", "broadcast_tensors",
    "meshgrid", "cdist", "norm", "stft", "istft", "atleast_1d", "atleast_2d", "atleast_3d",
    "block_diag", "cartesian_prod", "cumulative_trapezoid", "tensor_split", "unravel_index",
    "float", "double", "half", "bfloat16", "int", "long", "short", "bool", "byte", "char",
    "cpu", "cuda", "type", "size", "dim", "numel", "element_size", "stride", "is_contiguous",
    "is_floating_point", "is_complex", "tolist", "item", "view_as", "reshape_as", "expand_as",
    "type_as", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "get_device",
    "nelement", "ndimension", "data_ptr", "storage_offset", "numpy", "is_tensor",
    "is_nonzero", "result_type", "can_cast", "promote_types", "is_grad_enabled",
    # random or stateful only as the corrections say (by their flags)
    "dropout1d", "dropout2d", "dropout3d", "multi_head_attention_forward", "gumbel_softmax",
})
#: the subset of those whose result may share its input's storage
_ALIASING_TORCH_NAMES = frozenset({"flatten", "unflatten", "chunk", "split", "tensor_split",
                                   "view_as", "reshape_as", "expand_as", "type_as", "numpy",
                                   "float", "double", "half", "bfloat16", "int", "long", "short",
                                   "bool", "byte", "char", "cpu", "cuda", "type", "atleast_1d",
                                   "atleast_2d", "atleast_3d", "broadcast_tensors", "meshgrid"})
#: methods whose effect is outside any tensor (autograd hooks, streams)
_EFFECTFUL_METHODS = frozenset({"backward", "register_hook", "retain_grad", "record_stream",
                                "register_post_accumulate_grad_hook", "__setitem__",
                                "__delitem__", "apply_", "map_", "map2_"})
_RANDOM_TORCH_NAMES = frozenset({"rand", "randn", "randint", "randperm", "rand_like",
                                 "randn_like", "randint_like", "bernoulli", "multinomial",
                                 "normal", "poisson", "uniform_", "normal_", "exponential_",
                                 "geometric_", "cauchy_", "log_normal_", "random_",
                                 "bernoulli_"})


def _name_facts(name: str) -> OpFacts | None:
    """Facts of a torch-level op known by name (a torch function, functional or method)."""
    if name in _EFFECTFUL_METHODS:
        return None
    aten_facts = _aten_packet_facts(name)
    if is_inplace_name(name):
        return OpFacts(writes=(0,), random=name in _RANDOM_TORCH_NAMES or bool(
            aten_facts and aten_facts.random))
    if aten_facts is not None:
        return aten_facts
    if name in _RANDOM_TORCH_NAMES:
        return OpFacts(random=True)
    if name in _PURE_TORCH_NAMES:
        return OpFacts(pure=True, aliases=(0,) if name in _ALIASING_TORCH_NAMES else ())
    return None


# ---------------------------------------------------------------------------------------
# modules
# ---------------------------------------------------------------------------------------

_RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                   nn.FeatureAlphaDropout, nn.RReLU)


def _is_torch_module(mod: nn.Module) -> bool:
    return type(mod).__module__.startswith("torch.nn.") and not isinstance(mod, fx.GraphModule)


def _has_hooks(mod: nn.Module) -> bool:
    return bool(mod._forward_hooks or mod._forward_pre_hooks or getattr(
        mod, "_forward_hooks_with_kwargs", None) or nn.modules.module._global_forward_hooks
        or nn.modules.module._global_forward_pre_hooks)


def module_facts(mod: nn.Module, args: tuple = (), kwargs: dict | None = None) -> NodeFacts:
    """What calling ``mod`` does, judged by its type, mode and children (recursively).

    A torch ``nn`` module is pure unless it writes its input (``inplace=True``), is random
    in training (dropout and modules with a ``dropout`` probability: MultiheadAttention,
    LSTM/GRU/RNN, Transformer layers), updates running statistics in training, or holds
    such a child. Anything else — a user's leaf module, a GraphModule, a module with
    hooks or ``_is_impure`` — is unknown unless declared.
    """
    declared = _declared(type(mod))
    if declared is not None:
        return _apply(declared, None, args, kwargs or {}, f"declared {type(mod).__name__}")
    if getattr(mod, "_is_impure", False):
        return _unknown(f"{type(mod).__name__} is marked impure")
    if _has_hooks(mod):
        return _unknown(f"{type(mod).__name__} has forward hooks")
    if not _is_torch_module(mod):
        return _unknown(f"{type(mod).__qualname__} is not a torch.nn module (declare it with "
                        "fxopt.declare_op)")
    writes = _nodes_in(args[:1]) if getattr(mod, "inplace", False) is True else ()
    random = mod.training and (
        isinstance(mod, _RANDOM_MODULES)
        or isinstance(getattr(mod, "dropout", None), float) and mod.dropout > 0)
    if isinstance(mod, _RANDOM_MODULES) and getattr(mod, "p", 1.0) == 0:
        random = False
    stateful = (mod.training and isinstance(mod, nn.modules.batchnorm._NormBase)
                and getattr(mod, "running_mean", None) is not None)
    result = NodeFacts(writes=writes, random=bool(random), stateful=bool(stateful))
    for child in mod.children():
        inner = module_facts(child)
        if not inner.pure:
            # a child may write the parent's input (Sequential(ReLU(inplace=True), ...))
            result = replace(result, random=result.random or inner.random,
                             writes=_nodes_in(args) if inner.writes else result.writes,
                             stateful=result.stateful or inner.stateful,
                             collective=result.collective or inner.collective,
                             unknown=result.unknown or inner.unknown)
    if not result.pure:
        what = [w for w, on in (("writes its input", writes), ("random in training", random),
                                ("updates running statistics", stateful),
                                ("has an effectful child", result.unknown)) if on]
        result = replace(result, reason=f"{type(mod).__name__}: {', '.join(what) or 'effects'}")
    return result


# ---------------------------------------------------------------------------------------
# nodes
# ---------------------------------------------------------------------------------------


def _apply(op: OpFacts, bound: dict[str, Any] | None, args: tuple, kwargs: dict,
           what: str) -> NodeFacts:
    if op.pure:
        return NodeFacts(aliases=_nodes_in(_positions(op.aliases, bound, args, kwargs)))
    return NodeFacts(
        writes=_nodes_in(_positions(op.writes, bound, args, kwargs)),
        random=op.random, collective=op.collective, stateful=op.stateful,
        aliases=_nodes_in(_positions(op.aliases, bound, args, kwargs)),
        unknown=not (op.writes or op.random or op.collective or op.stateful),
        reason=what)


def _call_facts(target: Any, name: str | None, op: OpFacts | None, args: tuple,
                kwargs: dict, what: str) -> NodeFacts:
    """Facts of a call of a known op: torch's facts, then the corrections, then ``out=``."""
    if op is None:
        return _unknown(f"{what} is not known to be pure (declare it with fxopt.declare_op)")
    base = base_name(name) if name else None
    correction = _CORRECTIONS.get(base) if base else None
    bound = _bind(target, base, args, kwargs) if correction or op.writes or op.aliases else None
    if correction is not None and base in _CORRECTED_RANDOM and not is_inplace_name(name):
        op = replace(op, random=False, pure=not (op.writes or op.collective))
    result = _apply(op, bound, args, kwargs, what)
    if correction is not None and _applies(correction, bound):
        stateful = _nodes_in(_positions(correction.stateful_writes, bound, args, kwargs))
        written = _nodes_in(_positions(correction.writes, bound, args, kwargs))
        if stateful or written or correction.random:
            result = replace(result, writes=tuple(dict.fromkeys((*result.writes, *stateful,
                                                                 *written))),
                             stateful=result.stateful or bool(stateful),
                             random=result.random or correction.random, reason=what)
    out = kwargs.get("out")
    if out is not None:
        result = replace(result, writes=tuple(dict.fromkeys((*result.writes, *_nodes_in([out])))),
                         reason=what)
    if not result.pure and not result.reason:
        result = replace(result, reason=what)
    return result


def facts(node: fx.Node) -> NodeFacts:
    """What ``node`` does when it runs (see the module docstring for where it comes from)."""
    args, kwargs = tuple(node.args), dict(node.kwargs)
    if node.op in ("placeholder", "output"):
        return _unknown(node.op)
    if node.op == "get_attr":
        return _PURE
    if node.op == "call_module":
        owner = node.graph.owning_module
        try:
            mod = owner.get_submodule(node.target) if owner is not None else None
        except AttributeError:
            mod = None
        return _unknown(f"module {node.target!r} not found") if mod is None else module_facts(
            mod, args, kwargs)
    target = node.target
    if node.op == "call_method":
        return _call_facts(None, target, _name_facts(target), args, kwargs, f"method {target!r}")
    if node.op != "call_function":
        return _unknown(node.op)
    declared = _declared(target)
    if declared is not None:
        return _apply(declared, _bind(target, None, args, kwargs), args, kwargs,
                      f"declared {_describe(target)}")
    if isinstance(target, torch._ops.OpOverload):
        name = target._schema.name.split("::")[-1]
        return _call_facts(target, name, _overload_facts(target), args, kwargs,
                           _describe(target))
    if isinstance(target, torch._ops.OpOverloadPacket):
        name = target._qualified_op_name.split("::")[-1]
        return _call_facts(target, name, _packet_facts(target), args, kwargs, _describe(target))
    if isinstance(target, torch._ops.HigherOrderOperator):
        return _unknown(f"higher-order op {target.name()}")
    return _python_call_facts(target, args, kwargs)


def _python_call_facts(target: Callable, args: tuple, kwargs: dict) -> NodeFacts:
    try:
        if target in (operator.getitem, builtins.getattr):  # a view, `.data`, `.T`
            return NodeFacts(aliases=_nodes_in(args[:1]))
        if target in _PURE_OPERATORS or target in _PURE_BUILTINS:
            return _PURE
        if target in _INPLACE_OPERATORS or target in _WRITING_OPERATORS:
            return NodeFacts(writes=_nodes_in(args[:1]), reason=f"{_describe(target)} writes "
                                                                "its first argument")
    except TypeError:  # unhashable callable
        return _unknown(f"{_describe(target)} is not known to be pure")
    module = getattr(target, "__module__", "") or ""
    if module.startswith("torch.distributed"):
        return NodeFacts(collective=True, writes=_nodes_in(args[:1]),
                         reason=f"{_describe(target)} is a distributed call")
    name = torch_name(target)
    if name is None:
        return _unknown(f"{_describe(target)} is not known to be pure (declare it with "
                        "fxopt.declare_op)")
    facts_of = _name_facts(name)
    if kwargs.get("inplace") is True or _positional_inplace(target, args):
        facts_of = replace(facts_of or OpFacts(), pure=False, writes=(0,))
    return _call_facts(target, name, facts_of, args, kwargs, _describe(target))


def _positional_inplace(target: Callable, args: tuple) -> bool:
    """``F.relu(x, True)``: the ``inplace`` flag given by position."""
    position = _inplace_position(target)
    return position is not None and len(args) > position and args[position] is True


def _inplace_position(target: Callable) -> int | None:
    """Where ``target`` takes its ``inplace`` parameter by position (None: nowhere, or
    an unhashable target), read off its signature once."""
    try:
        return _INPLACE_POSITIONS[target]
    except KeyError:
        signature = signature_of(target)
        params = list(signature.parameters) if signature is not None else []
        position = _INPLACE_POSITIONS[target] = params.index("inplace") if "inplace" in params else None
        return position
    except TypeError:  # unhashable
        return None


_INPLACE_POSITIONS: dict[Any, int | None] = {}


def _describe(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)


# ---------------------------------------------------------------------------------------
# in-place twins
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    """How to spell the in-place form of an op. ``kind`` is one of:

    ``"function"`` call ``target(self, *rest)``; ``"method"`` call ``self.<target>(*rest)``;
    ``"flag"`` call the same function with ``inplace=True``; ``"module"`` call a copy of
    the module with ``inplace=True``; ``"overload"`` call the ATen overload ``target``.
    """

    kind: str
    target: Any = None
    commutative: bool = False


_OPERATORS = {
    operator.add: Variant("function", operator.iadd, commutative=True),
    operator.mul: Variant("function", operator.imul, commutative=True),
    operator.sub: Variant("function", operator.isub),
    operator.truediv: Variant("function", operator.itruediv),
}
_UNARY_FUNCTIONS = {torch.relu: torch.relu_, torch.sigmoid: torch.sigmoid_, torch.tanh: torch.tanh_,
                    torch.exp: torch.exp_, torch.neg: torch.neg_, torch.abs: torch.abs_,
                    torch.sqrt: torch.sqrt_, torch.clamp: torch.clamp_, torch.clamp_min: torch.clamp_min_,
                    torch.rsqrt: torch.rsqrt_, torch.reciprocal: torch.reciprocal_}
#: torch functions whose in-place form is a Tensor method (there is no torch.add_)
_METHOD_FUNCTIONS = {torch.add: "add_", torch.mul: "mul_", torch.sub: "sub_", torch.div: "div_",
                     torch.ge: "ge_", torch.gt: "gt_", torch.le: "le_", torch.lt: "lt_",
                     torch.eq: "eq_", torch.ne: "ne_", torch.masked_fill: "masked_fill_"}
_COMMUTATIVE_METHODS = frozenset({"add", "mul"})
_METHODS = frozenset({"add", "sub", "mul", "div", "relu", "sigmoid", "tanh", "clamp", "clamp_min",
                      "clamp_max", "neg", "exp", "abs", "sqrt", "rsqrt", "reciprocal", "masked_fill",
                      "ge", "gt", "le", "lt", "eq", "ne", "hardtanh"})
#: functionals with an ``inplace=`` flag (F.gelu has none: R11)
_FLAG_FUNCTIONS = frozenset({F.relu, F.relu6, F.hardtanh, F.silu, F.hardswish, F.hardsigmoid, F.elu,
                             F.celu, F.selu, F.leaky_relu, F.mish, F.threshold})
#: modules with an ``inplace`` attribute whose in-place form is elementwise (not Dropout:
#: in eval it returns its input itself)
_FLAG_MODULES = (nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.SiLU, nn.Hardswish, nn.Hardsigmoid, nn.ELU,
                 nn.CELU, nn.SELU, nn.LeakyReLU, nn.Mish, nn.Threshold)


def inplace_overload(target: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The in-place ATen overload with the same arguments as ``target``, if there is one."""
    schema = target._schema
    base = schema.name.split("::")[-1]
    namespace = getattr(torch.ops, schema.name.split("::")[0], None)
    packet = getattr(namespace, base + "_", None)
    overload = getattr(packet, schema.overload_name or "default", None)
    if overload is None or not isinstance(overload, torch._ops.OpOverload):
        return None
    ours, theirs = schema.arguments, overload._schema.arguments
    if len(ours) != len(theirs) or not theirs or theirs[0].alias_info is None:
        return None
    if any(a.name != b.name or str(a.type) != str(b.type) or a.kwarg_only != b.kwarg_only
           for a, b in zip(ours, theirs)):
        return None
    return overload


def inplace_variant(node: fx.Node, gm: fx.GraphModule) -> Variant | None:
    """The in-place spelling of ``node``'s op, or None when it has none (the ``inplace``
    pass's rule R11). Only deterministic elementwise ops are listed: their in-place form
    reads each element before writing it."""
    target = node.target
    if node.op == "call_function":
        if isinstance(target, torch._ops.OpOverload):
            overload = inplace_overload(target)
            if overload is None:
                return None
            commutative = target in (torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor)
            return Variant("overload", overload, commutative and "alpha" not in node.kwargs)
        try:
            if target in _OPERATORS:
                return _OPERATORS[target]
            if target in _UNARY_FUNCTIONS:
                return Variant("function", _UNARY_FUNCTIONS[target])
            if target in _METHOD_FUNCTIONS:
                commutative = target in (torch.add, torch.mul) and "alpha" not in node.kwargs
                return Variant("method", _METHOD_FUNCTIONS[target], commutative)
            if target in _FLAG_FUNCTIONS:
                return Variant("flag", target)
        except TypeError:  # unhashable callable
            return None
    elif node.op == "call_method" and target in _METHODS:
        commutative = target in _COMMUTATIVE_METHODS and "alpha" not in node.kwargs
        return Variant("method", target + "_", commutative)
    elif node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if type(mod) in _FLAG_MODULES and not mod.inplace:
            return Variant("module", mod)
    return None


# ---------------------------------------------------------------------------------------
# the questions passes ask
# ---------------------------------------------------------------------------------------


def is_pure(node: fx.Node) -> bool:
    """Removable when unused (DCE), mergeable with an identical twin (CSE), evaluable ahead
    of time when its inputs are constants (constant folding)."""
    return facts(node).pure


def has_side_effects(node: fx.Node) -> bool:
    """Whether running ``node`` does anything beyond producing its value (or is unknown)."""
    return not facts(node).pure


def mutated_inputs(node: fx.Node) -> list[fx.Node]:
    """The input nodes whose tensors ``node`` writes in place (empty if none)."""
    return list(facts(node).writes)


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` draws from the random number generator when it runs."""
    return facts(node).random


def is_collective(node: fx.Node) -> bool:
    """Whether ``node`` is a collective (or waits for one): never merged, dropped or moved."""
    return facts(node).collective


def output_aliases(node: fx.Node) -> tuple[fx.Node, ...]:
    """Inputs whose storage ``node``'s result may share, as far as torch's metadata and
    the corrections say; an unknown op may return any of its tensor inputs."""
    f = facts(node)
    if f.unknown:
        return tuple(node.all_input_nodes)
    return f.aliases


def unseen_aliases(node: fx.Node) -> tuple[fx.Node, ...]:
    """Inputs whose storage ``node``'s result may share although a FakeTensor run shows a
    fresh one: ``wait_tensor`` (a collective's result is its input's buffer) and any input
    of an unknown op (nothing vouches for its fake implementation). Views of known ops are
    not listed: the fake run shows them exactly."""
    f = facts(node)
    if f.unknown:
        return tuple(node.all_input_nodes)
    return f.aliases if f.collective else ()


def is_barrier(node: fx.Node) -> bool:
    """Whether no computation may be moved across ``node``: collectives, unknown ops and
    writes (random ops only reorder among themselves)."""
    f = facts(node)
    return f.collective or f.unknown or bool(f.writes) or f.stateful


# ---------------------------------------------------------------------------------------
# metadata: reads of a tensor's metadata only, results shaped like their input
# (added for the pattern matcher: a fold may keep shape-only uses of what it removes)
# ---------------------------------------------------------------------------------------

_METADATA_ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "device", "layout", "is_cuda",
                                  "is_sparse", "is_quantized", "requires_grad"})
_METADATA_NAMES = frozenset({"size", "dim", "ndimension", "numel", "stride", "sym_size",
                             "sym_numel", "sym_stride", "get_device", "is_contiguous",
                             "is_floating_point", "is_complex", "nelement"})
#: non-pointwise ops whose result has the shape, dtype and device of their first argument
_SAME_METADATA = frozenset({"batch_norm", "layer_norm", "group_norm", "instance_norm",
                            "rms_norm", "dropout", "alpha_dropout", "feature_dropout",
                            "softmax", "log_softmax", "_softmax", "_log_softmax"})


def reads_only_metadata(node: fx.Node) -> bool:
    """Whether ``node`` reads nothing of its first argument but metadata (``x.shape``,
    ``x.ndim``, ``x.size(0)``, ``len(x)``, ``aten.sym_size``): the values may change
    under it as long as the metadata does not."""
    target = node.target
    if node.op == "call_method":
        return target in _METADATA_NAMES
    if node.op != "call_function":
        return False
    if target is builtins.getattr:
        return len(node.args) == 2 and node.args[1] in _METADATA_ATTRIBUTES
    if target is builtins.len:
        return True
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return target.__name__.split(".")[0] in _METADATA_NAMES
    return torch_name(target) in _METADATA_NAMES


def keeps_input_metadata(name: str) -> bool:
    """Whether the op called ``name`` (canonical) returns a tensor with the shape, dtype
    and device of its first argument: unary pointwise ATen ops (by tag: ``relu``,
    ``gelu``, ``hardtanh``...) and the normalizations, dropout and softmax."""
    name = base_name(name)
    if name in _SAME_METADATA:
        return True
    packet = getattr(torch.ops.aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket) or "default" not in packet.overloads():
        return False
    op = packet.default
    tensors = [a for a in op._schema.arguments if isinstance(a.type, torch.TensorType)]
    return torch.Tag.pointwise in op.tags and len(tensors) == 1


def _check_targets() -> frozenset[Any]:
    aten = torch.ops.aten
    targets: set[Any] = {torch._assert, getattr(torch, "_assert_async", None)}
    for name in ("_assert_scalar", "_assert_async", "_assert_tensor_metadata",
                 "sym_constrain_range", "sym_constrain_range_for_size"):
        packet = getattr(aten, name, None)
        if packet is not None:
            targets.update(getattr(packet, o) for o in packet.overloads())
    targets.discard(None)
    return frozenset(targets)


_CHECKS = _check_targets()


def only_checks(node: fx.Node) -> bool:
    """Whether ``node`` only checks a condition (``torch._assert``, ``aten._assert_scalar``):
    it raises or does nothing. Never removed, but pure computations may move across it."""
    try:
        return node.op == "call_function" and node.target in _CHECKS
    except TypeError:  # unhashable target
        return False
