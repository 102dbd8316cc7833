"""fxopt.compile.timing: the device's time for a piece of work, without the host's."""

import time

import pytest
import torch

from fxopt.compile.timing import replay_time_ms, time_ms


@pytest.mark.gpu
def test_gpu_a_replay_is_timed_without_the_hosts_gaps_between_its_ops():
    """Two tiny kernels with 3 ms of host work between them: launched one by one, the gap is
    in the events' interval; replayed from a CUDA graph, only the kernels are."""
    x = torch.zeros(1024, device="cuda")

    def launch():
        x.add_(1)
        time.sleep(0.003)
        x.add_(1)

    assert time_ms(launch, x.device, 3) > 2.5
    before = x.clone()
    assert replay_time_ms(launch, x.device, 5) < 0.5
    # the warm-up ran the ops once and the timing replayed them 6 times (one warm-up, 5 timed):
    # the capture itself ran nothing
    torch.testing.assert_close(x, before + 2 * 7)
