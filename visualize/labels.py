"""Node labels: graphviz HTML-like tables that survive any text a graph can hold.

torch's ``FxGraphDrawer`` builds *record* labels, where ``{}|<>`` are syntax, so an
einsum equation or a module called ``a|b`` breaks it. HTML-like labels have a single
escaping rule set, which we apply to every piece of text:

- XML entities for ``& < > "`` (the label is parsed as XML);
- characters XML 1.0 forbids even as references (control characters, lone surrogates,
  U+FFFE/U+FFFF) are written as visible ``\\xNN`` escapes;
- a backslash gets a WORD JOINER (U+2060, invisible) after it: graphviz-pure expands
  ``\\N``, ``\\G``, ``\\L``... even inside HTML labels and reads ``\\\\`` as one backslash,
  while a backslash followed by U+2060 is no escape sequence in any Graphviz dialect.

Text is cut to a length limit *before* escaping, so an entity is never cut in half.
Everything read from ``node.meta`` is formatted defensively: metadata may hold any
object, and a label must never be the reason a render fails.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import graphviz
import torch
import torch.fx as fx

WORD_JOINER = "\u2060"
_FORBIDDEN = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff]")
_WHITESPACE = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _visible(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def clean(text: str, limit: int | None = None) -> str:
    """``text`` on one line, without characters XML cannot carry, cut to ``limit``."""
    for raw, shown in _WHITESPACE.items():
        text = text.replace(raw, shown)
    text = _FORBIDDEN.sub(_visible, text)
    if limit is not None and len(text) > limit:
        text = text[: max(limit - 1, 1)] + "…"
    return text


def html_text(text: str, limit: int | None = None) -> str:
    """``text`` escaped for the inside of a graphviz HTML-like label."""
    text = clean(text, limit)
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
    return text.replace("\\", "\\" + WORD_JOINER)


def attr_text(text: str, limit: int | None = 2000) -> str:
    """``text`` for a quoted DOT attribute (tooltips): ``graphviz`` quotes the ``"``, and
    :func:`graphviz.nohtml` keeps it from taking a text in ``<...>`` for an HTML-like label
    (it would write it unquoted: ``<!-- ... >`` then opens a comment that never ends)."""
    return graphviz.nohtml(clean(text, limit).replace("\\", "\\\\" + WORD_JOINER))


def safe_repr(value: Any, limit: int = 200) -> str:
    """``repr(value)``, or a placeholder when its ``__repr__`` raises."""
    try:
        text = repr(value)
    except Exception as exc:  # user objects in meta/args may have broken reprs
        text = f"<unprintable {type(value).__name__}: {type(exc).__name__}>"
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --- what a node shows ----------------------------------------------------------------


def target_text(node: fx.Node, root: torch.nn.Module | None = None) -> str:
    """The op's target as a user would write it: ``aten.conv2d.default``, ``.view``, ``block.0 (Conv2d)``."""
    target = node.target
    if node.op == "call_method":
        return f".{target}"
    if node.op == "call_module":
        kind = _module_type_name(node, root)
        return f"{target} ({kind})" if kind else str(target)
    if node.op == "call_function":
        try:
            name = fx.node._get_qualified_name(target)
        except Exception:
            return getattr(target, "__name__", None) or safe_repr(target)
        if name.startswith("_operator."):
            name = name[1:]
        return name.removeprefix("torch.ops.")
    return str(target)


def _module_type_name(node: fx.Node, root: torch.nn.Module | None) -> str | None:
    if root is not None:
        try:
            return type(root.get_submodule(str(node.target))).__name__
        except (AttributeError, TypeError):
            pass  # the module was replaced since (a before-snapshot): fall back to meta
    stack = node.meta.get("nn_module_stack")
    if isinstance(stack, dict) and stack:
        kind = list(stack.values())[-1]
        kind = kind[1] if isinstance(kind, tuple) and len(kind) > 1 else kind
        name = getattr(kind, "__name__", None) or str(kind)
        return name.rsplit(".", 1)[-1]
    return None


def args_text(node: fx.Node) -> str:
    """``(%x, %w, stride=[2, 2])``: the arguments, with other nodes as ``%name``."""
    if node.op in ("placeholder", "get_attr"):
        return ""
    parts = [_arg(a) for a in node.args]
    parts += [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
    return "(" + ", ".join(parts) + ")"


def _arg(value: Any) -> str:
    if isinstance(value, fx.Node):
        return f"%{value.name}"
    if isinstance(value, tuple):
        inner = ", ".join(_arg(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(_arg(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{safe_repr(k, 60)}: {_arg(v)}" for k, v in value.items()) + "}"
    if isinstance(value, torch.Tensor):
        return f"tensor({value_text(value)})"
    return safe_repr(value, 120)


_DTYPE_SHORT = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}


def value_text(value: Any, limit: int = 120) -> str:
    """Shape and dtype of a node's value from meta: ``f32[2, 16, 32, 32]``; '' if unknown."""
    try:
        return _value_text(value, depth=0)[:limit]
    except Exception:  # meta may hold anything: a label never fails because of it
        return ""


def _value_text(value: Any, depth: int) -> str:
    if value is None or depth > 3:
        return ""
    if isinstance(value, torch.Tensor) or _is_tensor_meta(value):
        dtype = value.dtype
        short = _DTYPE_SHORT.get(dtype, str(dtype).replace("torch.", ""))
        return f"{short}[{', '.join(str(d) for d in value.shape)}]"
    if isinstance(value, (list, tuple)):
        inner = [_value_text(v, depth + 1) for v in value]
        return "(" + ", ".join(t or "·" for t in inner) + ")" if any(inner) else ""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
        return f"{type(value).__name__} {value}"
    return ""


def _is_tensor_meta(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and isinstance(value.dtype, torch.dtype)


def meta_value(node: fx.Node) -> Any:
    """What the graph's metadata says the node computes (FakeTensor or TensorMetadata)."""
    meta = node.meta
    return meta.get("val", meta.get("tensor_meta", meta.get("example_value")))


# --- the table --------------------------------------------------------------------------

_OP_COLOURS = {
    "placeholder": "#dbeafe", "output": "#e5e7eb", "get_attr": "#fef3c7",
    "call_module": "#dcfce7", "call_method": "#f3e8ff", "call_function": "#ffffff",
}


def op_colour(op: str) -> str:
    return _OP_COLOURS.get(op, "#ffffff")


def table(rows: Iterable[tuple[str, str]]) -> str:
    """An HTML-like label from ``(already escaped html, style)`` rows; style is
    '' (plain), 'title', 'small', 'shape', 'note' or 'was' (struck out, red)."""
    cells = []
    for html, style in rows:
        if not html:
            continue
        if style == "title":
            html = f"<B>{html}</B>"
        elif style == "small":
            html = f'<FONT POINT-SIZE="9">{html}</FONT>'
        elif style == "shape":
            html = f'<FONT POINT-SIZE="9" COLOR="#1e3a8a">{html}</FONT>'
        elif style == "note":
            html = f'<FONT POINT-SIZE="9" COLOR="#6b7280">{html}</FONT>'
        elif style == "was":
            html = f'<FONT POINT-SIZE="9" COLOR="#b91c1c"><S>{html}</S></FONT>'
        cells.append(f'<TR><TD ALIGN="LEFT" BALIGN="LEFT">{html}</TD></TR>')
    return '<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="1">' + "".join(cells) + "</TABLE>>"


def node_rows(node: fx.Node, root: torch.nn.Module | None = None, limit: int = 60,
              show_args: bool = True) -> list[tuple[str, str]]:
    """The label rows of one node: name and op, target, arguments, shape and dtype."""
    rows = [(f'{html_text(node.name, limit)} <FONT POINT-SIZE="9" COLOR="#6b7280">'
             f'{html_text(node.op)}</FONT>', "title")]
    if node.op not in ("placeholder", "output"):
        rows.append((html_text(target_text(node, root), limit), ""))
    if show_args:
        rows.append((wrapped(args_text(node), limit), "small"))
    rows.append((html_text(value_text(meta_value(node)), limit), "shape"))
    return rows


def wrapped(text: str, width: int, max_lines: int = 3) -> str:
    """``text`` escaped and broken into at most ``max_lines`` lines of ``width``."""
    if not text:
        return ""
    text = clean(text, width * max_lines)
    lines = [text[i:i + width] for i in range(0, len(text), width)]
    return "<BR/>".join(html_text(line) for line in lines)


def tooltip(node: fx.Node, root: torch.nn.Module | None = None) -> str:
    """The full, uncut description shown when hovering a node in an SVG."""
    parts = [f"{node.name} = {node.op} {target_text(node, root)}{args_text(node)}",
             value_text(meta_value(node), 400)]
    return graphviz.nohtml("\\n".join(attr_text(p) for p in parts if p))  # DOT's \n: a line break
