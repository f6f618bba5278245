"""Every subcommand's typed flags, fuzzed at parse time: a value is either accepted as it is meant or refused as one
line (`rvqspec CMD: error: ...`, exit 2), never a traceback; refused values never reach a command."""

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rvqspec import cli

REQUIRED = {"--model": "m", "--corpus": "c", "--out": "o", "--text": "t", "--audio": "a", "--drafter": "reused"}


def subcommands(parser: argparse.ArgumentParser, prefix: tuple = ()) -> dict[tuple, argparse.ArgumentParser]:
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= subcommands(sub, prefix + (name,)) or {prefix + (name,): sub}
    return found


def typed_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [a.option_strings[-1] for a in parser._actions if a.option_strings and a.type is not None]


PARSER = cli.build_parser()
CASES = [(command, flag) for command, sub in subcommands(PARSER).items() for flag in typed_flags(sub)]
VALUES = st.one_of(st.integers(-2 ** 70, 2 ** 70).map(str), st.floats(allow_nan=True, allow_infinity=True).map(str),
                   st.sampled_from(["", "nan", "-inf", "1e400", "0", "-1", "x", "cuda", "cuda:9", "reused", "offsets",
                                    "/nonexistent/file", "."]), st.text(max_size=12))


def test_the_fuzzer_sees_every_typed_flag():
    commands = {command for command, _ in CASES}
    assert {("train-offsets",), ("calibrate",), ("bench",), ("eval",), ("demo",), ("synth",)} <= commands
    assert {(("train-offsets",), "--lr"), (("demo",), "--seed"), (("bench",), "--device")} <= set(CASES)


@pytest.mark.parametrize("command, flag", CASES, ids=[" ".join(c) + " " + f for c, f in CASES])
@settings(max_examples=40, deadline=None)
@given(value=VALUES)
def test_a_flag_value_parses_or_is_one_line(command, flag, value):
    sub = subcommands(PARSER)[command]
    required = [a.option_strings[-1] for a in sub._actions if a.required and a.option_strings]
    argv = [*command, *[x for name in required if name != flag for x in (name, REQUIRED.get(name, "x"))], flag, value]
    try:
        args = cli.build_parser().parse_args(argv)
    except cli.UsageError as e:
        assert "\n" not in str(e) and str(e).startswith("rvqspec")
        return
    parsed = getattr(args, flag.lstrip("-").replace("-", "_"))
    assert parsed is not None
