"""Writing an optimized program to disk, and reading it back.

Two formats, tried in this order by ``format="auto"``:

- ``pt2``: ``torch.export.export`` of the optimized GraphModule on the example inputs,
  written with ``torch.export.save`` to ``PATH.pt2`` (suffix added if missing). Portable,
  the preferred format; shapes are those of the example inputs.
- ``code``: for graphs torch.export cannot capture, the folder ``PATH`` (a ``.pt2``
  suffix dropped) written by ``torch.fx.GraphModule.to_folder``: ``module.py`` (the
  generated code: a ``FxModule`` class whose ``forward`` is ``gm.code``), ``state_dict.pt``
  (parameters and buffers; those the graph reads through a module it never calls, such as
  a quantized Linear's bias, as top-level entries), one ``NAME.pt`` per submodule that is
  not a plain ``torch.nn`` layer, and ``__init__.py``. ``module.py`` finds those files
  next to itself, so the folder can be copied or moved.

Loading the ``code`` format runs Python: ``module.py`` is imported, and each ``NAME.pt``
is a pickled module (``torch.load(..., weights_only=False)``), which can run any code;
only ``state_dict.pt`` loads with ``weights_only=True``. As with ``torch.load``, load only
folders you trust. The ``pt2`` format holds no Python.

Either way the program may call fxopt's own operators (``torch.ops.fxopt.*``,
``torch.ops.fxopt_quant.*``): :func:`load_program` registers them before loading; other
readers ``import fxopt.fused_ops, fxopt.quant.ops`` first.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn as nn

from fxopt.errors import SaveError
from fxopt.graph_utils import drop_unused_attributes, fetch_attr, fresh_attr_name

Format = Literal["auto", "pt2", "code"]


def save_program(gm: fx.GraphModule, path: str | Path, example_inputs: Sequence[Any], *,
                 format: Format = "auto") -> tuple[Path, str]:
    """Write ``gm`` (see the module doc); return where and in which format ("pt2" or "code")."""
    path = Path(path)
    if format not in ("auto", "pt2", "code"):
        raise SaveError(f"unknown format {format!r}; expected auto, pt2 or code")
    if format in ("auto", "pt2"):
        target = path if path.suffix == ".pt2" else path.with_name(path.name + ".pt2")
        try:
            program = torch.export.export(gm, tuple(example_inputs))
        except Exception as exc:
            if format == "pt2":
                raise SaveError(f"torch.export could not capture the optimized program "
                                f"({type(exc).__name__}: {_first_line(exc)}); save it as code") from exc
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            torch.export.save(program, target)
            return target, "pt2"
    folder = path.with_suffix("") if path.suffix == ".pt2" else path
    if folder.exists() and not folder.is_dir():
        raise SaveError(f"cannot write the code folder {folder}: a file of that name exists")
    existed = folder.exists()
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)  # to_folder makes only the last level
        _writable_copy(gm).to_folder(folder.resolve(), "FxModule")
        _load_from_own_folder(folder / "module.py", folder.resolve())
    except Exception as exc:
        if not existed:  # leave no half-written folder behind
            shutil.rmtree(folder, ignore_errors=True)
        raise SaveError(f"writing {folder} failed: {type(exc).__name__}: {_first_line(exc)}") from exc
    return folder, "code"


#: a ``torch.load`` of a file in the folder, as ``to_folder`` writes it: ``torch.load(r'PATH'...)``
_LOAD = re.compile(r"torch\.load\(r'(?P<path>[^']+)'(?P<rest>[^)]*)\)")
_PREAMBLE = "import pathlib\n_HERE = pathlib.Path(__file__).resolve().parent  # the saved folder\n"


def _load_from_own_folder(module_file: Path, folder: Path) -> None:
    """Rewrite ``to_folder``'s ``module.py`` to load its files from the folder it is in, not
    the absolute path it was written to, and the state dict (tensors only) with
    ``weights_only=True``. Raises if an absolute path is left (a ``to_folder`` this does
    not know): a folder that breaks once moved is not written."""
    def relative(match: re.Match) -> str:
        path = Path(match["path"])
        if path.parent != folder:
            return match[0]
        if path.name == "state_dict.pt":
            return "torch.load(_HERE / 'state_dict.pt', weights_only=True)"
        return f"torch.load(_HERE / {path.name!r}{match['rest']})"

    code = _LOAD.sub(relative, module_file.read_text())
    if str(folder) in code:
        raise SaveError(f"{module_file} names its folder by absolute path in a way fxopt does not rewrite")
    module_file.write_text(_PREAMBLE + code)


def load_program(path: str | Path) -> nn.Module:
    """A module that runs the program :func:`save_program` wrote at ``path`` (either format).

    For the ``code`` format this imports the folder's ``module.py`` and unpickles its
    ``NAME.pt`` submodules: it runs Python from the folder, like ``torch.load`` with
    ``weights_only=False``. Load only folders you trust."""
    import fxopt.fused_ops  # noqa: F401 - registers torch.ops.fxopt.*
    import fxopt.quant.ops  # noqa: F401 - registers torch.ops.fxopt_quant.*

    path = Path(path)
    if path.is_file():
        return torch.export.load(path).module()
    spec = importlib.util.spec_from_file_location(f"fxopt_saved_{abs(hash(path))}", path / "module.py")
    if spec is None or spec.loader is None or not (path / "module.py").is_file():
        raise SaveError(f"{path} is neither a .pt2 file nor a folder with module.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.FxModule()


def _writable_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` that ``to_folder`` writes as a folder that loads back: its tensors
    read through modules it never calls moved to the top (:func:`_tensors_at_top`), and
    no type annotations in its code (``to_folder`` writes them as names, such as
    ``_torch_Tensor_``, that its ``module.py`` never defines)."""
    from fxopt.optimize import copy_sharing_tensors

    copy = copy_sharing_tensors(gm)
    _tensors_at_top(copy)
    for node in copy.graph.nodes:
        node.type = None
    copy.recompile()
    return copy


def _tensors_at_top(gm: fx.GraphModule) -> None:
    """Make each tensor the graph reads (``get_attr``) through a module it never calls an
    attribute of ``gm`` itself, then drop the part of the module tree nothing names any more.

    Why: ``to_folder`` writes each ``torch.nn`` layer as its ``repr()`` (``Linear(...)``,
    which builds a complete layer) and loads ``state_dict.pt`` strictly. A rewrite may read a
    layer's tensors without calling it, and :func:`fxopt.graph_utils.drop_unused_attributes`
    then deletes the ones nothing reads: ``quantize`` drops a Linear's float weight and
    reads its bias through the Linear (``merge_sibling_linears``, ``constant_fold`` and
    pattern rules trim the tree the same way). In memory that is sound, the graph never
    calls the layer; written as a fresh ``Linear`` it expects a weight that was never saved.
    Saving is the one place that rebuilds a module from its class, so it is fixed here,
    once for every pass, rather than in each pass that trims the tree. Moved to the top,
    the tensors are plain entries of ``state_dict.pt`` and need no pickled holder module.

    A tensor read through a called module stays where it is (the module and the graph
    share it); a tensor read under several names gets one attribute, so it stays one tensor.
    """
    called = {node.target for node in gm.graph.nodes if node.op == "call_module"}
    top = {id(t): name for name, t in itertools.chain(gm._parameters.items(), gm._buffers.items())
           if t is not None}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or "." not in node.target:
            continue
        holders = itertools.accumulate(node.target.split(".")[:-1], lambda a, b: f"{a}.{b}")
        value = fetch_attr(gm, node.target)
        if not isinstance(value, torch.Tensor) or any(h in called for h in holders):
            continue
        if id(value) not in top:
            top[id(value)] = name = fresh_attr_name(gm, node.target)
            if isinstance(value, nn.Parameter):
                gm.register_parameter(name, value)
            else:
                gm.register_buffer(name, value)
        node.target = top[id(value)]
    drop_unused_attributes(gm)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]
