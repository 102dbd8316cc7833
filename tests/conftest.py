"""Suite-wide settings: the CI profile skips `slow` tests unless FXOPT_PROFILE=long, and
under CI hypothesis runs derandomized, so a green or red CI never depends on one run's luck
(local and long-profile runs keep exploring new examples).

Every test must also leave the process as it found it (``_no_leaked_state``): a test that
patches ``nn.Module.__call__``, leaves grad mode off or a fake mode entered, or changes a
Dynamo/Inductor config, breaks whichever test a worker runs next, so the suite's answer
would depend on the order and on ``-n``. The guard names the test that leaked and what, and
puts the state back so that one leak fails one test, not every test after it.
"""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
import warnings
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch
import torch._dynamo.config
import torch._functorch.config
import torch._guards
import torch._inductor.config
import torch.fx._symbolic_trace as fx_trace
import torch.fx.traceback as fx_traceback
import torch.utils._config_module as _config_module
import torch.utils._python_dispatch as python_dispatch

# Inductor imports this on its first compile, and on torch 2.11 that import adds a warnings
# filter (setuptools' pkg_resources): imported here, before the state guard's first snapshot,
# so that the guard does not blame it on whichever test compiled first
import torch.utils.cpp_extension  # noqa: F401
from hypothesis import settings

import fxopt.progress

LONG_PROFILE = os.environ.get("FXOPT_PROFILE") == "long"

settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI") and not LONG_PROFILE:
    settings.load_profile("ci")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``slow`` tests skip unless FXOPT_PROFILE=long; ``gpu`` tests (the GPU lane,
    docs/testing.md) skip where no CUDA device is present. Tests mark themselves ``gpu`` and
    never skip on ``torch.cuda.is_available()`` by themselves, so that ``pytest -m gpu`` runs
    every test that needs CUDA (tests/spine/test_gpu_marker.py checks)."""
    skip_slow = pytest.mark.skip(reason="slow: run with FXOPT_PROFILE=long")
    skip_gpu = pytest.mark.skip(reason="gpu: needs a CUDA device")
    cuda = torch.cuda.is_available()
    for item in items:
        if "slow" in item.keywords and not LONG_PROFILE:
            item.add_marker(skip_slow)
        if not cuda and item.get_closest_marker("gpu"):
            item.add_marker(skip_gpu)


# ---------------------------------------------------------------------------------------
# Process-wide state every test must leave as it found it.


@dataclass(frozen=True)
class Global:
    """One piece of process-wide state: how to read it, how to put a saved reading back
    (None where torch offers no way: then the leak is only reported), and how to say what
    changed (default: both readings)."""

    name: str
    read: Callable[[], object]
    write: Callable[[object], None] | None
    diff: Callable[[object, object], str] | None = None
    same: Callable[[object, object], bool] = lambda before, after: _equal(before, after)

    def describe(self, before: object, after: object) -> str:
        said = self.diff(before, after) if self.diff else f"{_short(before)} -> {_short(after)}"
        return f"{self.name}: {said}"


def _short(value: object, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _class_attribute(cls: type, attr: str) -> Global:
    """``cls.attr`` as the class defines it (torch.fx's tracer swaps ``nn.Module.__call__``
    and ``__getattr__`` while it traces, ``Tensor.__getitem__`` where it wraps methods)."""

    def write(value: object) -> None:
        if value is None:
            delattr(cls, attr)
        else:
            setattr(cls, attr, value)

    return Global(f"{cls.__module__}.{cls.__qualname__}.{attr}",
                  lambda: cls.__dict__.get(attr), write)


def _fx_wrapped_globals() -> dict[tuple[int, str], object]:
    """What each name given to ``torch.fx.wrap`` is bound to in its module: a trace swaps
    in a wrapper for its duration (a name wrapped during the test is new, not a leak)."""
    return {key: scope.get(key[1]) for key, scope in fx_trace._wrapped_fns_to_patch.items()}


def _write_fx_wrapped_globals(saved: object) -> None:
    assert isinstance(saved, dict)
    for key, value in saved.items():
        scope = fx_trace._wrapped_fns_to_patch.get(key)
        if scope is not None:
            scope[key[1]] = value


def _diff_fx_wrapped_globals(before: object, after: object) -> str:
    assert isinstance(before, dict) and isinstance(after, dict)
    return ", ".join(f"{key[1]} is now {_short(after[key], 80)}" for key in before
                     if key in after and after[key] is not before[key])


def _same_fx_wrapped_globals(before: object, after: object) -> bool:
    assert isinstance(before, dict) and isinstance(after, dict)
    return all(after.get(key, value) is value for key, value in before.items())


class _ConfigValues:
    """The values of a torch config module's options (``torch._dynamo.config`` ...), read
    straight from its entries: ``get_config_copy()`` costs ~0.5 ms per test for Inductor's
    600 options. Values, not overrides, are compared: torch's own ``config.patch`` sets an
    option back to its default value as an override on exit. A list, dict or set is
    copied, so a change made in place shows too."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.names = list(module._config)
        self.entries = [module._config[name] for name in self.names]
        self.defaults = [e.env_value_default if _is_set(e.env_value_default) else e.default
                         for e in self.entries]
        # torch 2.13 holds each override in a ContextVar (per thread), older ones in a field
        self.contextvar = isinstance(self.entries[0].user_override, ContextVar)

    def read(self) -> list[object]:
        if self.contextvar:
            overrides = [entry.user_override.get() for entry in self.entries]
        else:
            overrides = [entry.user_override for entry in self.entries]
        values = [v if _is_set(v) else d for v, d in zip(overrides, self.defaults)]
        return [v.copy() if isinstance(v, (list, dict, set)) else v for v in values]

    def changed(self, before: object, after: object) -> list[int]:
        assert isinstance(before, list) and isinstance(after, list)
        return [i for i, (b, a) in enumerate(zip(before, after)) if not _equal(b, a)]

    def write(self, saved: object) -> None:
        """Through the module's own ``setattr``, which keeps its hash and caches right."""
        assert isinstance(saved, list)
        for i in self.changed(saved, self.read()):
            setattr(self.module, self.names[i], saved[i])

    def diff(self, before: object, after: object) -> str:
        assert isinstance(before, list) and isinstance(after, list)
        return ", ".join(f"{self.names[i]}={_short(after[i], 80)}"
                         for i in self.changed(before, after))

    def glob(self) -> Global:
        return Global(self.module.__name__, self.read, self.write, self.diff,
                      lambda before, after: not self.changed(before, after))


def _is_set(value: object) -> bool:
    return value is not _config_module._UNSET_SENTINEL


def _equal(a: object, b: object) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # == raised or is ambiguous (an array): differs unless the same object
        return False


def _write_function_modes(saved: object) -> None:
    assert isinstance(saved, list)
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()
    for mode in saved:
        torch._C._push_on_torch_function_stack(mode)


def _write_dispatch_modes(saved: object) -> None:
    assert isinstance(saved, list)
    while torch._C._len_torch_dispatch_stack():
        python_dispatch._pop_mode()
    for mode in saved:
        python_dispatch._push_mode(mode)


def _write_warning_filters(saved: object) -> None:
    assert isinstance(saved, tuple)
    warnings.filters[:] = saved
    mutated = getattr(warnings, "_filters_mutated", None)  # drops warnings' own cache
    if mutated is not None:
        mutated()


# set by pytest (the phase it is in) and by torch itself, lazily, where unset: Inductor at
# its first compile (its C++ wrapper's pointer, its cache folder), at its first Triton kernel
# (Triton's cache folder, the ptxas it ships) and torch's profiler around CUDA graphs (CUPTI
# switches). No test's doing, and torch needs them to stay: put back (deleted), they are
# set again by the next test that meets them. (The suite's first GPU run errored its first
# two CUDA tests in teardown, message not captured; these are the settings torch makes
# lazily there.)
_NOT_BY_TESTS = frozenset({"PYTEST_CURRENT_TEST", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
                           "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_PTXAS_PATH",
                           "DISABLE_CUPTI_LAZY_REINIT", "TEARDOWN_CUPTI"})


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _NOT_BY_TESTS}


def _write_environ(saved: object) -> None:
    assert isinstance(saved, dict)
    for name in set(_environ()) - set(saved):
        del os.environ[name]
    os.environ.update(saved)


def _diff_dicts(before: object, after: object) -> str:
    assert isinstance(before, dict) and isinstance(after, dict)
    keys = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    return ", ".join(f"{k}: {_short(before.get(k), 60)} -> {_short(after.get(k), 60)}"
                     for k in keys)


def _write_cudnn_flags(saved: object) -> None:
    assert isinstance(saved, tuple)
    enabled, benchmark, deterministic = saved
    torch.backends.cudnn.enabled = enabled
    torch.backends.cudnn.benchmark = benchmark
    torch.backends.cudnn.deterministic = deterministic


def _default_device_context() -> object:
    """What ``torch.set_default_device`` entered (None: never called, or called with None)."""
    return getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)


def _device_of(context: object) -> str:
    return str(getattr(context, "device", None))


_INSTALLED = tuple({os.path.join(sysconfig.get_paths()[k], "") for k in ("purelib", "platlib")})


def _sys_path_by_tests(path: object) -> list[str]:
    """``sys.path`` less the folders inside site-packages, which installed packages add when
    first imported (setuptools its ``_vendor`` when Inductor first imports it)."""
    assert isinstance(path, list)
    return [p for p in path if not p.startswith(_INSTALLED)]


def _diff_sys_path(before: object, after: object) -> str:
    b, a = _sys_path_by_tests(before), _sys_path_by_tests(after)
    added, removed = [p for p in a if p not in b], [p for p in b if p not in a]
    return f"added {added}, removed {removed}" if added or removed else f"reordered: {a}"


def _write_sys_path(saved: object) -> None:
    assert isinstance(saved, list)
    sys.path[:] = saved + [p for p in sys.path if p.startswith(_INSTALLED) and p not in saved]


def _write_tls(attr: str) -> Callable[[object], None]:
    return lambda value: setattr(torch._guards._TLS, attr, value)


def _globals() -> tuple[Global, ...]:
    nn = torch.nn.Module
    patched_methods = [(nn, "__call__"), (nn, "__getattr__"), (nn, "__setattr__"),
                       (nn, "__delattr__"), (torch.Tensor, "__getitem__")]
    patched_methods += [m for m in fx_trace._wrapped_methods_to_patch if m not in patched_methods]
    configs = [torch._dynamo.config, torch._inductor.config, torch._functorch.config]
    eval_frame = torch._C._dynamo.eval_frame
    return (
        # first: the guard's own readings run torch functions, which a leaked mode intercepts
        Global("torch-function mode stack", torch.overrides._get_current_function_mode_stack,
               _write_function_modes),
        Global("dispatch mode stack (fake, proxy, functional modes...)",
               python_dispatch._get_current_dispatch_mode_stack, _write_dispatch_modes),
        *(_class_attribute(cls, attr) for cls, attr in patched_methods),
        Global("torch.fx.wrap-ed globals", _fx_wrapped_globals, _write_fx_wrapped_globals,
               _diff_fx_wrapped_globals, _same_fx_wrapped_globals),
        Global("torch.fx symbolic tracing flag", lambda: fx_trace._is_fx_tracing_flag,
               lambda v: setattr(fx_trace, "_is_fx_tracing_flag", v)),
        Global("torch.fx.traceback.has_preserved_node_meta()",
               fx_traceback.has_preserved_node_meta,
               lambda v: setattr(fx_traceback, "should_preserve_node_meta", v)),
        Global("torch.is_grad_enabled()", torch.is_grad_enabled, torch._C._set_grad_enabled),
        Global("torch.is_inference_mode_enabled()", torch.is_inference_mode_enabled, None),
        Global("torch.is_anomaly_enabled()", torch.is_anomaly_enabled, torch.set_anomaly_enabled),
        *(Global(f"torch.is_autocast_enabled({dev!r})",
                 lambda dev=dev: torch.is_autocast_enabled(dev),
                 lambda v, dev=dev: torch.set_autocast_enabled(dev, v))
          for dev in ("cpu", "cuda")),
        Global("torch.get_default_dtype()", torch.get_default_dtype, torch.set_default_dtype),
        # after the mode stack, which holds the DeviceContext that set_default_device enters
        Global("torch.set_default_device()", _default_device_context,
               lambda v: setattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", v),
               lambda before, after: f"{_device_of(before)} -> {_device_of(after)}"),
        # a fake mode entered on a machine without CUDA sets it, and only its exit clears it
        Global("torch._C._only_lift_cpu_tensors()", torch._C._only_lift_cpu_tensors,
               torch._C._set_only_lift_cpu_tensors),
        Global("torch._guards.TracingContext", torch._guards.TracingContext.try_get,
               _write_tls("tracing_context")),
        Global("torch._guards.CompileContext", torch._guards.CompileContext.try_get,
               _write_tls("compile_context")),
        *([Global("Dynamo's frame evaluation callback", eval_frame.get_eval_frame_callback,
                  eval_frame.set_eval_frame)]
          if hasattr(eval_frame, "get_eval_frame_callback") else []),  # not in every torch
        Global("torch.are_deterministic_algorithms_enabled()",
               lambda: (torch.are_deterministic_algorithms_enabled(),
                        torch.is_deterministic_algorithms_warn_only_enabled()),
               lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
        Global("torch.get_float32_matmul_precision()", torch.get_float32_matmul_precision,
               torch.set_float32_matmul_precision),
        Global("torch.backends.cudnn flags",
               lambda: (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark,
                        torch.backends.cudnn.deterministic),
               _write_cudnn_flags),
        Global("torch.get_num_threads()", torch.get_num_threads, torch.set_num_threads),
        *(_ConfigValues(module).glob() for module in configs),
        Global("fxopt.progress.set_progress()", lambda: fxopt.progress._default,
               fxopt.progress.set_progress),
        *(Global(f"logging level of {name or 'the root logger'}",
                 lambda name=name: logging.getLogger(name).level,
                 lambda v, name=name: logging.getLogger(name).setLevel(v))
          for name in (None, "torch", "fxopt")),
        Global("warnings.filters", lambda: tuple(warnings.filters), _write_warning_filters),
        Global("os.environ", _environ, _write_environ, _diff_dicts),
        Global("os.getcwd()", os.getcwd, os.chdir),
        Global("sys.path", lambda: list(sys.path), _write_sys_path,
               _diff_sys_path,
               lambda before, after: _sys_path_by_tests(before) == _sys_path_by_tests(after)),
    )


GLOBALS = _globals()


def snapshot() -> list[object]:
    """A reading of every piece of state in GLOBALS."""
    return [g.read() for g in GLOBALS]


def restore_leaks(before: list[object]) -> list[str]:
    """What differs from ``before`` (one line per piece of state), each put back."""
    leaked = []
    for g, old in zip(GLOBALS, before):
        new = g.read()
        if g.same(old, new):
            continue
        line = g.describe(old, new)
        if g.write is None:
            line += " (cannot be put back: every later test on this worker sees it)"
        else:
            g.write(old)
        leaked.append(line)
    return leaked


@pytest.fixture(autouse=True)
def _no_leaked_state(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails (as a teardown error of this test) the test that changed process-wide state."""
    before = snapshot()
    yield
    leaked = restore_leaks(before)
    if leaked:
        pytest.fail(f"{request.node.nodeid} left process-wide state changed (now put back):\n  "
                    + "\n  ".join(leaked), pytrace=False)


@pytest.fixture
def state_guard() -> tuple[Callable[[], list[object]], Callable[[list[object]], list[str]]]:
    """``(snapshot, restore_leaks)``, for the tests of the guard itself."""
    return snapshot, restore_leaks
