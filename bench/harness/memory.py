"""Device memory as the project counts it: reserved from before the first call.

What a user pays is what the caching allocator reserves, compile-time transients, CUDA-graph
pools and fxopt's own copies included, so the peaks are reset before the workload's first
call and read after its last. Allocated is recorded too: it says how much of the
reservation the tensors themselves hold.
"""

from __future__ import annotations

from types import TracebackType

import torch


class DeviceMemory:
    """``with DeviceMemory(device) as mem: ...`` then ``mem.record()`` (or ``mem = DeviceMemory(device).start()``
    ... ``mem.stop()``, where the span crosses other blocks): MB of the reservation before, and
    of the peak reserved and allocated during the span (empty off the GPU)."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.figures: dict[str, float] = {}

    def start(self) -> DeviceMemory:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.figures["base_reserved_MB"] = torch.cuda.memory_reserved(self.device) / 1e6
        return self

    def stop(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.figures["peak_reserved_MB"] = torch.cuda.max_memory_reserved(self.device) / 1e6
            self.figures["peak_allocated_MB"] = torch.cuda.max_memory_allocated(self.device) / 1e6
        return self.record()

    def __enter__(self) -> DeviceMemory:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def record(self) -> dict[str, float]:
        return dict(self.figures)
