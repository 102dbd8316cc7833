"""Turning DOT text into SVG or PNG with whichever Graphviz renderer is installed.

The ``graphviz`` Python package runs a program called ``dot`` found on PATH, which a
fresh machine does not have. The PyPI wheel ``graphviz-pure`` (a dependency of fxopt)
is a statically linked Graphviz that installs a command called ``graphviz-pure``, often
in a virtual environment's ``bin`` that is not on PATH; so we resolve its path
ourselves and run it directly. A system ``dot`` is used when it is the only renderer
present, or when asked for. DOT text itself never needs a renderer.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from fxopt.errors import RendererNotFoundError, RenderError

#: formats a renderer produces; "dot" is the DOT text itself
FORMATS = ("svg", "png", "dot")
_SUFFIXES = {".svg": "svg", ".png": "png", ".dot": "dot", ".gv": "dot"}

HOW_TO_GET_ONE = (
    "install a renderer with `pip install graphviz-pure` (an fxopt dependency), "
    "or install Graphviz itself (e.g. `apt-get install graphviz`), or pass renderer=PATH"
)


def find_renderer(renderer: str | os.PathLike | None = None) -> str:
    """The resolved path of the program that will render DOT.

    ``renderer`` is None or ``"auto"`` (graphviz-pure, else a system ``dot``),
    ``"graphviz-pure"``, ``"dot"`` (system Graphviz only) or a path to a program.
    The environment variable ``FXOPT_DOT`` sets the default.
    """
    choice = str(renderer or os.environ.get("FXOPT_DOT") or "auto")
    if choice == "auto":
        candidates = ["graphviz-pure", "dot"]
    elif choice in ("graphviz-pure", "dot"):
        candidates = [choice]
    else:
        path = Path(choice).expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            return str(path.resolve())
        raise RendererNotFoundError(f"renderer {choice!r} is not an executable file; {HOW_TO_GET_ONE}")
    for name in candidates:
        found = _which(name)
        if found:
            return found
    asked = "no Graphviz renderer found" if choice == "auto" else f"renderer {choice!r} not found"
    raise RendererNotFoundError(f"{asked}; {HOW_TO_GET_ONE}")


def _which(name: str) -> str | None:
    """``name`` on PATH, or next to this interpreter (a venv's bin that is not on PATH)."""
    found = shutil.which(name)
    if found:
        return str(Path(found).resolve())
    for folder in {sysconfig.get_path("scripts"), str(Path(sys.executable).parent)}:
        found = shutil.which(name, path=folder)
        if found:
            return str(Path(found).resolve())
    return None


def format_of(path: Path, fmt: str | None) -> str:
    fmt = fmt or _SUFFIXES.get(path.suffix.lower())
    if fmt not in FORMATS:
        raise RenderError(f"cannot tell the output format of {str(path)!r}: give a .svg, .png, "
                          f".dot or .gv path, or format= one of {FORMATS}")
    return fmt


def run_renderer(source: str, fmt: str, renderer: str | os.PathLike | None = None,
                 timeout: float | None = None, engine: str = "dot") -> bytes:
    """Render DOT ``source`` to ``fmt`` ('svg' or 'png') and return the bytes."""
    program = find_renderer(renderer)
    try:
        done = subprocess.run([program, f"-K{engine}", f"-T{fmt}", "-q"], input=source.encode("utf-8"),
                              capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise RenderError(f"{Path(program).name} did not finish rendering within {timeout} s; "
                          "render a focused view (render_diff(focus=k)) or a collapsed one "
                          "(render(collapse_depth=d))") from None
    if done.returncode != 0 or not done.stdout:
        message = done.stderr.decode("utf-8", "replace").strip()[-2000:]
        raise RenderError(f"{Path(program).name} failed with exit code {done.returncode}: {message}")
    return done.stdout


def emit(source: str, path_or_format: str | os.PathLike, fmt: str | None = None,
         renderer: str | os.PathLike | None = None, timeout: float | None = None) -> str | bytes | Path:
    """Write ``source`` rendered to a path, or return it for a bare format name.

    ``"svg"``/``"dot"`` return text, ``"png"`` returns bytes; a path gets the file and
    is returned. When rendering fails the DOT text is still written (next to the path,
    as ``.dot``) and the error says where.
    """
    if isinstance(path_or_format, str) and path_or_format in FORMATS and fmt is None:
        fmt = path_or_format
        if fmt == "dot":
            return source
        data = run_renderer(source, fmt, renderer, timeout)
        return data.decode("utf-8") if fmt == "svg" else data
    path = Path(path_or_format)
    fmt = format_of(path, fmt)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "dot":
        path.write_text(source, encoding="utf-8")
        return path
    try:
        data = run_renderer(source, fmt, renderer, timeout)
    except RenderError as exc:
        dot_path = path.with_suffix(".dot")
        dot_path.write_text(source, encoding="utf-8")
        raise type(exc)(str(exc), str(dot_path)) from None
    path.write_bytes(data)
    return path
