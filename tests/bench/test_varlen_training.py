"""bench/varlen_training.py's own logic, without compiling: its smoke runs the step eagerly
(compiling a training step costs a minute on a CPU), so what it does with the compiled
variants' rows is checked here."""

import harness
import pytest


@pytest.fixture(scope="module")
def varlen(bench_script):
    return bench_script("varlen_training")


def test_the_modes_are_the_harness_modes_a_training_step_can_use_and_max_autotune(varlen):
    """Freezing changes inference graphs only: in a training step it is the same mode again."""
    assert varlen.MODES == ("inductor", "reduce_overhead", "max_autotune_no_cudagraphs", "max_autotune")
    assert set(varlen.MODES) - set(varlen.AUTOTUNE) <= set(harness.INDUCTOR_MODES)


def test_speedup_per_length_is_against_the_fastest_mode_that_ran(varlen):
    rows = [{"variant": "fxopt", "ms_128": 10.0, "ms_384": 30.0},
            {"variant": "inductor", "ms_128": 12.0, "ms_384": 33.0},
            {"variant": "reduce_overhead", "ms_128": 11.0, "ms_384": 36.0},
            {"variant": "max_autotune", "error": "skipped: budget"},
            {"variant": "eager", "ms_128": 5.0, "ms_384": 5.0}]  # not an Inductor mode
    got = varlen.speedups(rows, [128, 384, 256])
    assert got["128"] == {"best_inductor": "reduce_overhead", "speedup": pytest.approx(1.1),
                          "modes_measured": ["inductor", "reduce_overhead"]}
    assert got["384"]["best_inductor"] == "inductor" and got["384"]["speedup"] == pytest.approx(1.1)
    assert "256" not in got  # no variant timed it


def test_no_speedup_without_fxopt(varlen):
    assert varlen.speedups([{"variant": "inductor", "ms_128": 1.0}], [128]) == {}
