"""Pass protocol, registry and textual pipelines: parsing, validation, ordering."""

import re
from typing import ClassVar

import pytest
import torch
import torch.fx as fx
from hypothesis import given
from hypothesis import strategies as st

import fxopt
from fxopt.pipeline import Fixpoint, SequencePass, check_ordering, parse_pipeline, resolve


@fxopt.register_pass
class _Tunable(fxopt.Pass):
    """A do-nothing pass with one option of each type, for parser tests."""

    name = "test_tunable"
    options: ClassVar = {
        "rounds": fxopt.Option(int, 1, "an int"),
        "ratio": fxopt.Option(float, 0.5, "a float"),
        "mode": fxopt.Option(str, "fast", "a choice", choices=("fast", "exact", "int8_weight_only")),
        "strict": fxopt.Option(bool, False, "a bool"),
    }

    def run(self, gm, ctx):
        return False


def test_names_and_options_are_parsed_and_typed():
    passes = parse_pipeline("cse, test_tunable{rounds=3,ratio=2,mode=exact,strict=true} ,dce")
    assert [p.name for p in passes] == ["cse", "test_tunable", "dce"]
    assert passes[1].options == {"rounds": 3, "ratio": 2.0, "mode": "exact", "strict": True}
    assert isinstance(passes[1].options["ratio"], float)


def test_nested_composites():
    (fix,) = parse_pipeline("fixpoint{max_rounds=4}(cse,sequence(dce,remove_dropout))")
    assert isinstance(fix, Fixpoint) and fix.options["max_rounds"] == 4
    assert isinstance(fix.children[1], SequencePass)
    assert [p.name for p in fix.flatten()] == ["cse", "dce", "remove_dropout"]


def test_quoted_values_keep_separators():
    (p,) = parse_pipeline("test_tunable{mode='int8_weight_only'}")
    assert p.options["mode"] == "int8_weight_only"


def test_unknown_pass_suggests_close_names():
    with pytest.raises(fxopt.UnknownPassError) as info:
        parse_pipeline("cse,constant_fodl")
    assert info.value.name == "constant_fodl"
    assert "constant_fold" in info.value.suggestions
    assert "constant_fold" in str(info.value)


@pytest.mark.parametrize(
    ("text", "option", "fragment"),
    [
        ("test_tunable{rounds=three}", "rounds", "expected int"),
        ("test_tunable{strict=maybe}", "strict", "expected a bool"),
        ("test_tunable{mode=slow}", "mode", "not one of"),
        ("test_tunable{color=red}", "color", "unknown option"),
    ],
)
def test_bad_options_name_pass_and_option(text, option, fragment):
    with pytest.raises(fxopt.PassOptionError) as info:
        parse_pipeline(text)
    assert info.value.pass_name == "test_tunable" and info.value.option == option
    assert fragment in str(info.value)


def test_options_from_python_are_type_checked():
    with pytest.raises(fxopt.PassOptionError, match="expected int, got bool"):
        _Tunable(rounds=True)
    assert _Tunable(ratio=1).options["ratio"] == 1.0


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty pipeline"),
        ("cse,,dce", "expected a pass name at column 4"),
        ("cse{", "expected '}'"),
        ("cse{=1}", "expected an option name"),
        ("test_tunable{rounds}", "expected '='"),
        ("test_tunable{rounds=}", "expected a value"),
        ("test_tunable{rounds=1,rounds=2}", "given twice"),
        ("fixpoint(cse", "expected ')'"),
        ("cse(dce)", "not a composite pass"),
        ("cse dce", "unexpected 'dce'"),
        ("fixpoint{max_rounds=0}(cse)", "option 'max_rounds': must be at least 1"),
    ],
)
def test_syntax_errors_point_at_the_problem(text, fragment):
    with pytest.raises(fxopt.PipelineError, match=re.escape(fragment)):
        parse_pipeline(text)


@given(
    rounds=st.integers(0, 10**6),
    ratio=st.floats(-1e6, 1e6, allow_nan=False),
    mode=st.sampled_from(["fast", "exact", "int8_weight_only"]),
    strict=st.booleans(),
)
def test_repr_round_trips_through_the_parser(rounds, ratio, mode, strict):
    original = _Tunable(rounds=rounds, ratio=ratio, mode=mode, strict=strict)
    (parsed,) = parse_pipeline(repr(original))
    assert parsed.options == original.options


def test_resolve_accepts_every_form():
    def my_fn(gm):
        return None

    passes = resolve(["cse", fxopt.get_pass_class("dce"), _Tunable(rounds=2), my_fn, ["dce", "cse"]])
    assert [p.name for p in passes] == ["cse", "dce", "test_tunable", "my_fn", "sequence"]
    with pytest.raises(fxopt.PipelineError, match="not a pass"):
        resolve([42])


def test_ordering_constraints_are_checked_before_running():
    class Early(fxopt.Pass):
        name = "early"

        def run(self, gm, ctx):
            return False

    class Late(fxopt.Pass):
        name = "late"
        after = ("early",)

        def run(self, gm, ctx):
            return False

    check_ordering([Early(), Late()])
    check_ordering([Late()])  # the constraint only binds when both are present
    ran = []

    def spy(gm):
        ran.append(1)

    with pytest.raises(fxopt.PipelineError, match="'late' must run after 'early'"):
        fxopt.PassManager([spy, Late(), Early()])
    assert ran == []


def test_registering_a_different_pass_under_a_taken_name_fails():
    with pytest.raises(ValueError, match="already registered"):
        @fxopt.register_pass
        class Impostor(fxopt.Pass):
            name = "cse"

            def run(self, gm, ctx):
                return False


def test_cli_lists_required_passes(capsys):
    from fxopt.cli import main

    assert main(["passes"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line and not line[0].isspace()}
    assert {"dce", "cse", "constant_fold", "remove_dropout", "eliminate_identity"} <= listed


def test_function_pass_returning_garbage_is_a_contract_error():
    gm = fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(fxopt.PassContractError, match="'bad'.*returned int"):
        fxopt.optimize(gm, passes=[fxopt.FunctionPass(lambda g: 3, name="bad")])
