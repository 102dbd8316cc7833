"""Bad patterns and replacements fail when the rule is created, with the reason."""

from __future__ import annotations

import fxopt.patterns as fp
import pytest
import torch

from fxopt.errors import FxoptError, PatternError


def add_relu(x, y):
    return torch.relu(x + y)


def test_unused_argument() -> None:
    def pattern(x, y, unused):
        return torch.relu(x + y)

    with pytest.raises(PatternError, match="unused are never used"):
        fp.rule(pattern, lambda x, y: x)


def test_dead_code() -> None:
    def pattern(x, y):
        torch.sigmoid(x)
        return torch.relu(x + y)

    with pytest.raises(PatternError, match="dead code"):
        fp.rule(pattern, add_relu)


def test_untraceable_pattern_says_why() -> None:
    def pattern(x, y):
        if x.sum() > 0:
            return torch.relu(x + y)
        return x

    with pytest.raises(PatternError, match=r"cannot trace pattern pattern\(x, y\).*TraceError|cannot trace"):
        fp.rule(pattern, add_relu)


def test_replacement_signature_mismatch_names_both() -> None:
    def replacement(x, z):
        return x + z

    with pytest.raises(PatternError) as info:
        fp.rule(add_relu, replacement)
    message = str(info.value)
    assert "replacement(x, z)" in message and "add_relu(x, y)" in message and "z" in message


def test_replacement_output_count_mismatch() -> None:
    with pytest.raises(PatternError, match="returns 2 value"):
        fp.rule(add_relu, lambda x, y: (x, y))


def test_constraint_on_unknown_argument() -> None:
    with pytest.raises(PatternError, match="no such argument"):
        fp.rule(add_relu, add_relu, w=fp.rank(2))


def test_pattern_returning_its_input() -> None:
    with pytest.raises(PatternError, match="computed values"):
        fp.rule(lambda x: x, lambda x: x)


def test_module_with_parameters_in_a_pattern() -> None:
    def pattern(x):
        return torch.nn.Linear(3, 3)(x)

    with pytest.raises(PatternError, match="functional form"):
        fp.rule(pattern, pattern)


def test_errors_are_fxopt_errors() -> None:
    assert issubclass(PatternError, FxoptError) and issubclass(PatternError, ValueError)


def test_a_rule_given_with_arguments_of_its_own_is_an_error_not_ignored() -> None:
    r = fp.rule(lambda x: torch.relu(x), lambda x: torch.clamp_min(x, 0.0))
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    before = gm.code
    with pytest.raises(PatternError, match="replacement_callback"):
        fp.replace(gm, r, replacement_callback=lambda m: (lambda x: x))
    with pytest.raises(PatternError, match="where"):
        fp.replace(gm, r, where=lambda m: False)
    assert gm.code == before  # untouched
    assert fp.replace(gm, r) == 1
