"""Progress bars (fxopt.progress): on stderr only where someone watches, forced on request,
silenced globally, and the PassManager's bar only for runs longer than its delay."""

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import time

import torch
import torch.nn as nn

import fxopt
from fxopt.progress import progress, set_progress


def test_silent_when_stderr_is_not_a_terminal(capsys):
    assert list(progress(range(3), desc="counting")) == [0, 1, 2]
    assert capsys.readouterr().err == ""


def test_shows_when_forced(capsys):
    list(progress(range(3), desc="counting", enabled=True))
    err = capsys.readouterr().err
    assert "counting" in err


def _stderr_on_a_terminal(code: str) -> str:
    """Run ``code`` with stderr on a pseudo-terminal; what it wrote there."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a real size
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=slave, stdout=subprocess.DEVNULL)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    proc.wait(timeout=120)
    os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_shows_on_a_terminal_unless_switched_off():
    code = ("import time\nfrom fxopt.progress import progress, set_progress\n"
            "for _ in progress(range(2), desc='shown-{}'): time.sleep(0.05)\n"
            "set_progress(False)\n"
            "for _ in progress(range(2), desc='hidden-{}'): time.sleep(0.05)\n")
    err = _stderr_on_a_terminal(code.replace("{}", "bar"))
    assert "shown-bar" in err
    assert "hidden-bar" not in err


class _Small(nn.Module):
    def forward(self, x):
        return torch.relu(x) + 1


def _slow(gm):
    time.sleep(2.3)  # longer than the PassManager bar's delay


def test_pass_manager_bar_appears_only_on_long_runs(capsys):
    gm = torch.fx.symbolic_trace(_Small())
    fxopt.optimize(gm, ["cse", "dce"], progress=True)
    assert capsys.readouterr().err == ""  # well under the 2 s delay
    fxopt.optimize(gm, [_slow, "dce"], progress=True)
    err = capsys.readouterr().err
    assert "optimizing" in err and "_slow" in err


def test_set_progress_false_silences_default_bars(capsys):
    set_progress(False)
    try:
        list(progress(range(3), desc="counting"))
    finally:
        set_progress(None)
    assert capsys.readouterr().err == ""
