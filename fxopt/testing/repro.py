"""Write a GraphModule, its inputs and the passes that break it as one runnable script.

The script needs only torch and fxopt: the graph is written as Python source (the
GraphModule's own generated code), submodules are rebuilt from their ``repr`` when it
is evaluable (every stock ``torch.nn`` layer) and pickled otherwise, and the tensors
(parameters, buffers, constants, inputs) are embedded exactly, base64-encoded, so the
failure reproduces bit for bit. Passes are referenced by registry name or import path.
"""

from __future__ import annotations

import base64
import inspect
import io
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from fxopt.graph_utils import fetch_attr
from fxopt.pass_protocol import FunctionPass, Pass
from fxopt.pipeline import Composite, Fixpoint


def _blob(obj: Any) -> str:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return "\n".join(textwrap.wrap(base64.b64encode(buffer.getvalue()).decode(), 96))


def _module_source(module: nn.Module) -> tuple[str, Any]:
    """Python that builds ``module``, or (None, module) if it must be pickled."""
    text = repr(module)
    if "\n" not in text and type(module).__module__.startswith("torch.nn"):
        source = f"torch.nn.{text}"
        try:
            rebuilt = eval(source, {"torch": torch, "inf": float("inf")})  # noqa: S307 (our own repr)
            if type(rebuilt) is type(module) and rebuilt.state_dict().keys() == module.state_dict().keys():
                return source, None
        except Exception:
            pass
    return "", module


def _import_line(name: str, obj: Any) -> str:
    if inspect.ismodule(obj):
        return f"import {obj.__name__} as {name}"
    if isinstance(obj, float):
        return f"{name} = float({str(obj)!r})"
    if isinstance(obj, str) and obj.replace(".", "").replace("_", "").isalnum():
        return f"{name} = {obj}"  # a type annotation spelled as a dotted path
    if obj is type(None):
        return f"{name} = type(None)"
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if module == "builtins":
        return f"{name} = {qualname}"
    if module and qualname and "<" not in qualname:
        head, _, rest = qualname.partition(".")
        return f"from {module} import {head} as {name}" if not rest else \
            f"import {module} as _m_{name}\n{name} = _m_{name}.{qualname}"
    raise ValueError(f"cannot write an import for global {name!r} ({obj!r})")


def _pass_source(passes: Any) -> tuple[list[str], str]:
    """(import lines, expression) recreating ``passes``."""
    if passes is None:
        return [], "None"
    if isinstance(passes, str):
        return [], repr(passes)
    if isinstance(passes, (list, tuple)):
        imports, items = [], []
        for p in passes:
            more, expr = _pass_source(p)
            imports += more
            items.append(expr)
        return imports, "None" if "None" in items else f"[{', '.join(items)}]"
    if isinstance(passes, Fixpoint):
        imports, children = _pass_source(passes.children)
        return imports, f"fxopt.Fixpoint({children}, max_rounds={passes.options['max_rounds']})"
    if isinstance(passes, Composite):  # sequences; a conditional's predicate cannot be written
        return _pass_source(passes.children)
    if isinstance(passes, FunctionPass):
        return _pass_source(passes.fn)
    target = type(passes) if isinstance(passes, Pass) else passes
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        name = getattr(passes, "name", None) or getattr(target, "__name__", "?")
        return [f"# pass {name!r} is not importable (defined in a script or a function): "
                "define it in a module to run it here"], "None"
    line = f"{qualname.split('.')[0]} = _load({module!r}, {_source_file(target)!r}).{qualname.split('.')[0]}"
    expr = qualname
    if isinstance(passes, Pass):
        changed = {k: v for k, v in passes.options.items() if v != type(passes).options[k].default}
        expr = f"{qualname}(**{changed!r})"
    return [line], expr


def _source_file(obj: Any) -> str | None:
    try:
        return inspect.getsourcefile(obj)
    except TypeError:
        return None


_PRELUDE = '''\
import base64
import importlib
import importlib.util
import io
import sys

import torch
import fxopt
from fxopt.testing import assert_equivalent


def _load(module, path):
    """Import `module`, or load it from `path` when it is not importable (a test file)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        spec = importlib.util.spec_from_file_location(module.rpartition(".")[2], path)
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = loaded
        spec.loader.exec_module(loaded)
        return loaded


def _tensors(blob):
    return torch.load(io.BytesIO(base64.b64decode("".join(blob.split()))), weights_only=False)


def _attach(root, path, value):
    *parents, leaf = path.split(".")
    for part in parents:
        if not hasattr(root, part):
            root.add_module(part, torch.nn.Module())
        root = getattr(root, part)
    if isinstance(value, torch.nn.Module):
        root.add_module(leaf, value)
    elif isinstance(value, torch.nn.Parameter):
        root.register_parameter(leaf, value)
    else:
        setattr(root, leaf, value)
'''


def repro_source(gm: fx.GraphModule, inputs: Sequence[Any], passes: Any = None, *,
                 rtol: float | None = None, atol: float | None = None, title: str = "") -> str:
    """The text of a standalone script that rebuilds ``gm``, runs ``passes`` on it and
    asserts equivalence on ``inputs`` (it fails the way the original failed)."""
    code = gm.graph.python_code(root_module="self")
    lines = [f'"""{title or "fxopt repro"}\n\nRun: python {{this file}}. Written by fxopt.testing."""', "",
             _PRELUDE]
    lines += sorted({_import_line(name, obj) for name, obj in code.globals.items()
                     if name not in ("torch", "fxopt") and not name.startswith("__")})
    pass_imports, pass_expr = _pass_source(passes)
    lines += [*pass_imports, "", ""]

    used = {n.target for n in gm.graph.nodes if n.op in ("call_module", "get_attr")}
    builders, pickled, tensors = [], {}, {}
    for target in sorted(used):
        value = fetch_attr(gm, target)
        if isinstance(value, nn.Module):
            source, leftover = _module_source(value)
            if source:
                builders.append(f"        _attach(self, {target!r}, {source})")
                tensors.update({f"{target}.{k}": v for k, v in value.state_dict(keep_vars=True).items()})
            else:
                pickled[target] = leftover
        elif isinstance(value, torch.Tensor):
            tensors[target] = value.detach() if not isinstance(value, nn.Parameter) else value
    lines += ["class Repro(torch.nn.Module):", "    def __init__(self):", "        super().__init__()"]
    lines += builders or ["        pass"]
    lines += ["", textwrap.indent(code.src.strip("\n"), "    "), "", ""]
    lines += [f'STATE = """\n{_blob({k: v for k, v in tensors.items()})}\n"""', "",
              f'MODULES = """\n{_blob(pickled)}\n"""' if pickled else 'MODULES = None', "",
              f'INPUTS = """\n{_blob(tuple(inputs))}\n"""', "",
              f"PASSES = {pass_expr}", f"RTOL, ATOL = {rtol!r}, {atol!r}", "", ""]
    lines += ['''def build():
    model = Repro()
    for name, module in (_tensors(MODULES) if MODULES else {}).items():
        _attach(model, name, module)
    state = _tensors(STATE)
    for name, value in state.items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if isinstance(getattr(module, leaf, None), torch.Tensor) and leaf in dict(
                module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False)):
            with torch.no_grad():
                getattr(module, leaf).copy_(value)
        else:
            _attach(model, name, value)
    return torch.fx.symbolic_trace(model.eval()), _tensors(INPUTS)


if __name__ == "__main__":
    gm, inputs = build()
    print(gm.code)
    if PASSES is not None:
        optimized = fxopt.optimize(gm, passes=PASSES, example_inputs=inputs)
        print(optimized.code)
        assert_equivalent(gm, optimized, inputs, rtol=RTOL, atol=ATOL)
        print("equivalent: the bug no longer reproduces")
''']
    return "\n".join(lines)


def write_repro(path: str | Path, gm: fx.GraphModule, inputs: Sequence[Any], passes: Any = None, *,
                rtol: float | None = None, atol: float | None = None, title: str = "") -> Path:
    """Write :func:`repro_source` to ``path`` and return it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(repro_source(gm, inputs, passes, rtol=rtol, atol=atol, title=title))
    return path


