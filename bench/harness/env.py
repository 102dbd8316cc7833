"""What a figure was measured on: the environment record written with every result."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import re
import subprocess
from collections.abc import Iterator
from typing import Any

import torch


@functools.cache
def commit() -> str | None:
    """The checkout's commit (None where there is no git checkout: the device gets a bare copy)."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def gpu_name() -> str:
    """The GPU's name. A process that has not touched CUDA asks ``nvidia-smi``: a parent that
    only starts worker processes keeps the GPU free of a context (and its memory) of its own."""
    if not torch.cuda.is_initialized():
        try:
            done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=30)
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return torch.cuda.get_device_name()


def environment(device: str) -> dict[str, Any]:
    """GPU name (``cpu`` off the GPU), torch, triton and cuDNN versions, commit, CPU and cores."""
    record: dict[str, Any] = {
        "device": gpu_name() if device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "python": platform.python_version(), "commit": commit(),
        "cpu": platform.processor() or platform.machine(), "cores": len(os.sched_getaffinity(0)),
    }
    if device.startswith("cuda"):
        record["gpus"] = torch.cuda.device_count()
        record["cudnn"] = torch.backends.cudnn.version()
    try:
        import triton

        record["triton"] = triton.__version__
    except ImportError:
        record["triton"] = None
    return record


def slug(device_name: str) -> str:
    """The results folder of a device: ``NVIDIA H100 80GB HBM3`` → ``h100``, ``cpu`` → ``cpu``.

    The model number alone (memory size and package vary between machines of one kind, and the
    figures are compared by kind); a name without one becomes its lowercase words, dashed.
    """
    name = device_name.lower().replace("nvidia", "").strip()
    model = re.search(r"\b([a-z]{1,2}\d{2,4}[a-z]?)\b", name)
    if model:
        return model.group(1)
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "unknown"


@contextlib.contextmanager
def cpu_threads(n: int | None) -> Iterator[None]:
    """``n`` torch CPU threads inside the block (None: as they are), put back after it: a
    bench run in-process, as the smoke tests run it, leaves the process as it found it."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
