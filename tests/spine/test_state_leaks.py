"""The suite's guard against leaked process-wide state (``tests/conftest.py``) can fail:
each kind of state, changed by a test and not put back, is named and then restored; and
in a real pytest run the test that leaked errors by name while the next one still passes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch._dynamo.config
import torch._functorch.config
import torch._inductor.config
import torch.fx._symbolic_trace as fx_trace
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

import fxopt.progress


def wrapped_helper(x: torch.Tensor) -> torch.Tensor:
    return x + 1


torch.fx.wrap("wrapped_helper")


def _set_call() -> None:
    torch.nn.Module.__call__ = lambda self, *args, **kwargs: None


def _set_getattr() -> None:
    torch.nn.Module.__getattr__ = lambda self, name: None


def _set_wrapped_global() -> None:
    globals()["wrapped_helper"] = lambda x: x


# (name the guard must report, the leak, a check on torch itself once the guard put it back)
LEAKS: dict[str, tuple[str, Callable[[], object], Callable[[], bool]]] = {
    "module_call": ("torch.nn.modules.module.Module.__call__", _set_call,
                    lambda: torch.nn.Module.__call__ is fx_trace._orig_module_call),
    "module_getattr": ("torch.nn.modules.module.Module.__getattr__", _set_getattr,
                       lambda: torch.nn.Module.__getattr__ is fx_trace._orig_module_getattr),
    "fx_wrap": ("torch.fx.wrap-ed globals: wrapped_helper is now", _set_wrapped_global,
                lambda: wrapped_helper(torch.zeros(1)).item() == 1.0),
    "fx_tracing": ("torch.fx symbolic tracing flag",
                   lambda: setattr(fx_trace, "_is_fx_tracing_flag", True),
                   lambda: not torch.fx._symbolic_trace.is_fx_tracing()),
    "grad": ("torch.is_grad_enabled(): True -> False", lambda: torch.set_grad_enabled(False),
             torch.is_grad_enabled),
    "anomaly": ("torch.is_anomaly_enabled()", lambda: torch.set_anomaly_enabled(True),
                lambda: not torch.is_anomaly_enabled()),
    "autocast": ("torch.is_autocast_enabled('cpu')",
                 lambda: torch.set_autocast_enabled("cpu", True),
                 lambda: not torch.is_autocast_enabled("cpu")),
    "default_dtype": ("torch.get_default_dtype(): torch.float32 -> torch.float64",
                      lambda: torch.set_default_dtype(torch.float64),
                      lambda: torch.empty(1).dtype is torch.float32),
    "default_device": ("torch.set_default_device(): None -> meta",
                       lambda: torch.set_default_device("meta"),
                       lambda: torch.empty(1).device.type == "cpu"),
    "function_mode": ("torch-function mode stack", lambda: TorchFunctionMode().__enter__(),
                      lambda: torch._C._len_torch_function_stack() == 0),
    "fake_mode": ("dispatch mode stack", lambda: FakeTensorMode().__enter__(),
                  lambda: torch._guards.detect_fake_mode() is None
                  and not isinstance(torch.ones(1), torch._subclasses.FakeTensor)),
    "dynamo_config": ("torch._dynamo.config: verbose=True",
                      lambda: setattr(torch._dynamo.config, "verbose", True),
                      lambda: torch._dynamo.config.verbose is False),
    "dynamo_config_in_place": ("torch._dynamo.config: reorderable_logging_functions={<built-in function print>}",
                               lambda: torch._dynamo.config.reorderable_logging_functions.add(print),
                               lambda: print not in torch._dynamo.config.reorderable_logging_functions),
    "inductor_config": ("torch._inductor.config: freezing=True",
                        lambda: setattr(torch._inductor.config, "freezing", True),
                        lambda: torch._inductor.config.freezing is False),
    "functorch_config": ("torch._functorch.config: activation_memory_budget=0.5",
                         lambda: setattr(torch._functorch.config, "activation_memory_budget", 0.5),
                         lambda: torch._functorch.config.activation_memory_budget == 1.0),
    "deterministic": ("torch.are_deterministic_algorithms_enabled(): (False, False) -> (True, False)",
                      lambda: torch.use_deterministic_algorithms(True),
                      lambda: not torch.are_deterministic_algorithms_enabled()),
    "matmul_precision": ("torch.get_float32_matmul_precision(): 'highest' -> 'medium'",
                         lambda: torch.set_float32_matmul_precision("medium"),
                         lambda: torch.get_float32_matmul_precision() == "highest"),
    "warnings": ("warnings.filters", lambda: warnings.simplefilter("error"),
                 lambda: warnings.filters[0][0] != "error"),
    "progress": ("fxopt.progress.set_progress(): None -> False",
                 lambda: fxopt.progress.set_progress(False),
                 lambda: fxopt.progress._default is None),
    "torch_log_level": ("logging level of torch: ",  # torch sets a level of its own first
                        lambda: logging.getLogger("torch").setLevel(logging.CRITICAL),
                        lambda: logging.getLogger("torch").level < logging.CRITICAL),
    "sys_path": ("sys.path: ", lambda: sys.path.insert(0, "/no/such/folder"),
                 lambda: "/no/such/folder" not in sys.path),
    "environ": ("os.environ: FXOPT_LEAKED: None -> '1'",
                lambda: os.environ.__setitem__("FXOPT_LEAKED", "1"),
                lambda: "FXOPT_LEAKED" not in os.environ),
}


@pytest.mark.parametrize("kind", LEAKS)
def test_each_kind_of_leaked_state_is_named_and_put_back(kind: str, state_guard) -> None:
    snapshot, restore_leaks = state_guard
    expected, leak, restored = LEAKS[kind]
    before = snapshot()
    try:
        leak()
    finally:
        leaked = restore_leaks(before)
    assert any(line.startswith(expected) for line in leaked), leaked
    assert restored(), f"{kind}: the guard did not put the state back"
    assert restore_leaks(before) == []


def test_inference_mode_cannot_be_put_back_but_is_named(state_guard) -> None:
    snapshot, restore_leaks = state_guard
    before = snapshot()
    mode = torch.inference_mode()
    mode.__enter__()
    try:
        leaked = restore_leaks(before)
    finally:
        mode.__exit__(None, None, None)
    assert ("torch.is_inference_mode_enabled(): False -> True (cannot be put back: "
            "every later test on this worker sees it)") in leaked, leaked


def test_a_clean_test_reports_nothing(state_guard) -> None:
    snapshot, restore_leaks = state_guard
    before = snapshot()
    with torch.no_grad(), torch._dynamo.config.patch(verbose=True), warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.nn.Linear(2, 2)(torch.ones(2))
        torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert restore_leaks(before) == []


LEAKING_SUITE = '''
import torch

def test_leaks_grad_mode():
    torch.set_grad_enabled(False)

def test_runs_after_it():
    assert torch.is_grad_enabled()
'''


def test_a_run_errors_the_leaking_test_by_name_and_the_next_test_passes(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text((Path(__file__).parents[1] / "conftest.py").read_text())
    (tmp_path / "test_leak.py").write_text(LEAKING_SUITE)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
         "test_leak.py"], capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "ERROR at teardown of test_leaks_grad_mode" in out, out
    assert ("test_leak.py::test_leaks_grad_mode left process-wide state changed (now put back):\n"
            "  torch.is_grad_enabled(): True -> False") in out, out
    assert "2 passed, 1 error" in out, out
