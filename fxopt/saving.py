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
readers ``import fxopt.compile.fused_ops, fxopt.quant.ops`` first.

Versions. Every program carries ``fxopt_format.json`` (in the ``.pt2`` archive's extra
files, or in the folder): ``{"fxopt_format": FORMAT_VERSION, "weights": {"int8": 1,
"int4": 2}}``, the versions of the program layout and of each quantized weight format
(:data:`fxopt.quant.formats.WEIGHT_FORMATS`), because a packed weight is a plain integer
tensor whose bytes do not say how to read them. :func:`load_program` loads the same
versions as they are, converts int4 weights of packing 1 (the packing of fxopt before
2026-11-26) and raises :class:`~fxopt.errors.SavedFormatError`, naming both versions and
what to do, for anything else. A program without the file was saved before versions were
written: format 0, whose int8 weights are version 1 (the only one) and whose int4 weights
may be in either packing, so loading one with int4 weights asks which
(``load_program(path, int4_format=1 or 2)``).

Shared tensors. A tensor read under several names (tied weights, or a tensor the graph
reads both through a layer it calls and through one it does not) is one tensor on load:
``torch.export`` keeps it one; the ``code`` format writes its bytes once in
``state_dict.pt`` and ``module.py`` loads that with ``assign=True``, so every name gets the
same storage. The pickled ``NAME.pt`` modules hold no tensor ``state_dict.pt`` holds
(their places are ``meta`` tensors, filled on load), so no bytes are written twice.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn as nn

from fxopt.errors import SavedFormatError, SaveError
from fxopt.graph_utils import drop_unused_attributes, fetch_attr, fresh_attr_name
from fxopt.quant.formats import INT4_FORMAT_VERSION, WEIGHT_FORMATS, convert_int4

Format = Literal["auto", "pt2", "code"]

#: the layout of a saved program. 0: saved before versions were written (no
#: ``fxopt_format.json``); 1: versions written, code folders load with ``assign=True``
FORMAT_VERSION = 1
#: the file (in the folder, or among the ``.pt2`` archive's extra files) that holds the versions
VERSIONS_FILE = "fxopt_format.json"
#: the weight format versions a program may hold: the current ones, and those converted on load
_READABLE = {"int8": (WEIGHT_FORMATS["int8"],), "int4": (1, INT4_FORMAT_VERSION)}


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
            torch.export.save(program, target, extra_files={VERSIONS_FILE: _versions_text()})
            return target, "pt2"
    folder = path.with_suffix("") if path.suffix == ".pt2" else path
    if folder.exists() and not folder.is_dir():
        raise SaveError(f"cannot write the code folder {folder}: a file of that name exists")
    existed = folder.exists()
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)  # to_folder makes only the last level
        copy = _writable_copy(gm)
        state = copy.state_dict()
        _leave_tensors_out(copy)
        copy.to_folder(folder.resolve(), "FxModule")
        torch.save(state, folder / "state_dict.pt")  # a storage under several names: written once
        _load_from_own_folder(folder / "module.py", folder.resolve())
        (folder / VERSIONS_FILE).write_text(_versions_text())
    except Exception as exc:
        if not existed:  # leave no half-written folder behind
            shutil.rmtree(folder, ignore_errors=True)
        raise SaveError(f"writing {folder} failed: {type(exc).__name__}: {_first_line(exc)}") from exc
    return folder, "code"


#: a ``torch.load`` of a file in the folder, as ``to_folder`` writes it: ``torch.load(r'PATH'...)``
_LOAD = re.compile(r"torch\.load\(r'(?P<path>[^']+)'(?P<rest>[^)]*)\)")
_PREAMBLE = "import pathlib\n_HERE = pathlib.Path(__file__).resolve().parent  # the saved folder\n"
_LOAD_STATE = "self.load_state_dict(torch.load(_HERE / 'state_dict.pt', weights_only=True))"


def _load_from_own_folder(module_file: Path, folder: Path) -> None:
    """Rewrite ``to_folder``'s ``module.py`` to load its files from the folder it is in, not
    the absolute path it was written to, and the state dict (tensors only) with
    ``weights_only=True`` and ``assign=True`` (the module takes the loaded tensors, so
    names that share a storage in the file share it in the module, and the ``meta``
    placeholders of :func:`_leave_tensors_out` are replaced). Raises if an absolute path
    is left or the state dict's load is not found (a ``to_folder`` this does not know): a
    folder that breaks once moved, or loads untied, is not written."""
    def relative(match: re.Match) -> str:
        path = Path(match["path"])
        if path.parent != folder:
            return match[0]
        if path.name == "state_dict.pt":
            return "torch.load(_HERE / 'state_dict.pt', weights_only=True)"
        return f"torch.load(_HERE / {path.name!r}{match['rest']})"

    code = _LOAD.sub(relative, module_file.read_text())
    if code.count(_LOAD_STATE) != 1:
        raise SaveError(f"{module_file} loads its state dict in a way fxopt does not rewrite")
    code = code.replace(_LOAD_STATE, _LOAD_STATE.removesuffix(")") + ", assign=True)")
    if str(folder) in code:
        raise SaveError(f"{module_file} names its folder by absolute path in a way fxopt does not rewrite")
    module_file.write_text(_PREAMBLE + code)


def load_program(path: str | Path, *, int4_format: int | None = None) -> nn.Module:
    """A module that runs the program :func:`save_program` wrote at ``path`` (either format).

    Weights saved in an older format are converted (int4 packing 1), others refused with a
    :class:`~fxopt.errors.SavedFormatError` naming both versions (see the module doc).
    ``int4_format`` says which int4 packing a program saved before versions were written
    holds (1: fxopt before 2026-11-26, 2: after); a versioned program says it itself.

    For the ``code`` format this imports the folder's ``module.py`` and unpickles its
    ``NAME.pt`` submodules: it runs Python from the folder, like ``torch.load`` with
    ``weights_only=False``. Load only folders you trust."""
    import fxopt.compile.fused_ops  # noqa: F401 - registers torch.ops.fxopt.*
    import fxopt.quant.ops  # noqa: F401 - registers torch.ops.fxopt_quant.*

    path = Path(path)
    if path.is_file():
        extra = {VERSIONS_FILE: ""}
        program = torch.export.load(path, extra_files=extra)
        versions = _read_versions(path, extra[VERSIONS_FILE] or None, int4_format)
        module = program.module()
    else:
        spec = importlib.util.spec_from_file_location(f"fxopt_saved_{abs(hash(path))}", path / "module.py")
        if spec is None or spec.loader is None or not (path / "module.py").is_file():
            raise SaveError(f"{path} is neither a .pt2 file nor a folder with module.py")
        written = path / VERSIONS_FILE
        versions = _read_versions(path, written.read_text() if written.is_file() else None, int4_format)
        code = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = code
        spec.loader.exec_module(code)
        module = code.FxModule()
    _convert_int4(module, versions["int4"], path)
    return module


def _versions_text() -> str:
    return json.dumps({"fxopt_format": FORMAT_VERSION, "weights": WEIGHT_FORMATS})


def _read_versions(path: Path, text: str | None, int4_format: int | None) -> dict[str, int | None]:
    """The weight format versions of the program at ``path`` from its versions file
    (``text``; None where it has none); int4 None where it cannot be known. Raises
    :class:`SavedFormatError` for a layout or weight format this fxopt does not read."""
    if int4_format is not None and int4_format not in (1, INT4_FORMAT_VERSION):
        raise SavedFormatError(f"load_program(int4_format={int4_format!r}): the int4 packings are 1 "
                               f"(fxopt before 2026-11-26) and {INT4_FORMAT_VERSION}")
    if text is None:  # format 0: int8 had one version; int4 packing changed unrecorded
        return {"int8": 1, "int4": int4_format}
    try:
        saved = json.loads(text)
        layout, weights = saved["fxopt_format"], dict(saved["weights"])
    except (ValueError, KeyError, TypeError) as exc:
        raise SavedFormatError(f"{path}: {VERSIONS_FILE} is not what fxopt writes ({type(exc).__name__}: "
                               f"{_first_line(exc)}); save the program again with this fxopt") from exc
    if layout != FORMAT_VERSION:
        raise SavedFormatError(f"{path} is saved in program format {layout!r}; this fxopt reads format "
                               f"{FORMAT_VERSION} (and 0, from before versions were written): load it with "
                               f"the fxopt that saved it, or save it again with this one")
    if int4_format is not None and weights.get("int4") != int4_format:
        raise SavedFormatError(f"{path} says its int4 weights are packing {weights.get('int4')!r}, "
                               f"not int4_format={int4_format}: leave int4_format out")
    for name, version in weights.items():
        if version not in _READABLE.get(name, ()):
            raise SavedFormatError(f"{path} holds {name} weights in format version {version!r}; this fxopt "
                                   f"reads {name} versions {list(_READABLE.get(name, ()))}: quantize the "
                                   f"model again and save it with this fxopt")
    return {"int8": weights.get("int8"), "int4": weights.get("int4")}


class _EveryModuleALeaf(fx.Tracer):
    """Traces only the top module's code: the graph a saved ``module.py`` runs."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def _convert_int4(module: nn.Module, version: int | None, path: Path) -> None:
    """Repack in place the int4 weights of a just-loaded ``module`` written with packing
    ``version`` (None: unknown, which is an error only where there are int4 weights).
    A weight read by several ops (merged or tied layers) is converted once."""
    if version == INT4_FORMAT_VERSION:
        return
    graph = module.graph if isinstance(module, fx.GraphModule) else _EveryModuleALeaf().trace(module)
    op = torch.ops.fxopt_quant.int4_weight_only_linear
    done: set[int] = set()
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in (op, op.default):
            continue
        if version is None:
            raise SavedFormatError(
                f"{path} holds int4 weights but does not say their packing (saved without format versions: "
                f"format 0, by fxopt before versions were written; this fxopt writes format {FORMAT_VERSION}); "
                f"they are packing 1 (fxopt before 2026-11-26) or {INT4_FORMAT_VERSION}: say which with "
                f"load_program(path, int4_format=...), or quantize the model again and save it with this fxopt")
        weight = node.kwargs.get("w", node.args[1] if len(node.args) > 1 else None)
        group = node.kwargs.get("group_size", node.args[3] if len(node.args) > 3 else None)
        if not isinstance(weight, fx.Node) or weight.op != "get_attr" or not isinstance(group, int):
            raise SavedFormatError(f"{path}: int4 node {node.name} does not read its weight as an attribute "
                                   f"with a constant group size, so its packing {version} cannot be converted "
                                   f"to {INT4_FORMAT_VERSION}: quantize the model again and save it with this fxopt")
        packed = fetch_attr(module, weight.target)
        if id(packed) not in done:
            done.add(id(packed))
            with torch.no_grad():
                packed.copy_(convert_int4(packed, group, version))


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


def _leave_tensors_out(gm: fx.GraphModule) -> None:
    """Replace, in ``gm``'s module tree (a copy: the modules are its own), each tensor of
    the state dict by a ``meta`` tensor of its shape: ``to_folder`` pickles every submodule
    that is not a plain layer with its tensors, which ``state_dict.pt`` holds already.
    ``module.py`` loads the state dict with ``assign=True``, which puts the real ones back."""
    for module in gm.modules():
        for name, value in module._parameters.items():
            if value is not None:
                module._parameters[name] = nn.Parameter(value.detach().to("meta"), requires_grad=value.requires_grad)
        for name, value in module._buffers.items():
            if value is not None and name not in module._non_persistent_buffers_set:
                module._buffers[name] = value.to("meta")


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
