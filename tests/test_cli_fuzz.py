"""Every subcommand's typed flags, fuzzed at parse time: a value is either accepted as it is meant or refused as one
line (`rvqspec CMD: error: ...`, exit 2), never a traceback; refused values never reach a command."""

import argparse
from pathlib import Path

import pytest
from hypothesis import event, given, settings, strategies as st

from rvqspec.cli.main import UsageError, build_parser, main

from benchmarks import make_results

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


PARSER = build_parser()
CASES = [(command, flag) for command, sub in subcommands(PARSER).items() for flag in typed_flags(sub)]
VALUES = st.one_of(st.integers(-2 ** 70, 2 ** 70).map(str), st.floats(allow_nan=True, allow_infinity=True).map(str),
                   st.sampled_from(["", "nan", "-inf", "1e400", "0", "-1", "x", "cuda", "cuda:9", "reused", "offsets",
                                    "/nonexistent/file", ".", __file__]), st.text(max_size=12))  # __file__: a file


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
        args = build_parser().parse_args(argv)
    except UsageError as e:
        assert "\n" not in str(e) and str(e).startswith("rvqspec")
        return
    parsed = getattr(args, flag.lstrip("-").replace("-", "_"))
    assert parsed is not None


# ---------------------------------------------------------------- commands run on tiny fixtures


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    from helpers.synthetic import write_model_and_corpus

    root = tmp_path_factory.mktemp("fuzz")
    model, corpus = write_model_and_corpus(root / "data", utterances=24)
    (root / "a-file.txt").write_text("not a folder")
    (root / "keep").mkdir()
    (root / "keep" / "mine.txt").write_text("the user's")
    return {"model": model, "corpus": corpus, "file": root / "a-file.txt", "keep": root / "keep", "root": root}


def paths(fixtures, kind: str, name: str) -> str:
    return str({"missing": fixtures["root"] / "missing" / name, "file": fixtures["file"], "keep": fixtures["keep"],
                "valid": fixtures.get(name, fixtures["root"] / "out" / name)}[kind])


PATH_KINDS = st.sampled_from(["valid", "valid", "valid", "missing", "file", "keep"])  # valid runs too
NUMBERS = st.sampled_from(["1", "2", "3", "-1", "0", "nan", "inf", "1e9", "x", ""])


@settings(max_examples=40, deadline=None)
@given(command=st.sampled_from(["calibrate", "train-offsets", "inspect", "results"]), model=PATH_KINDS,
       corpus=PATH_KINDS, out=PATH_KINDS, number=NUMBERS, budgets=st.sampled_from(["1,2", "0", "2,x", "5000", "3"]),
       dtype=st.sampled_from(["float32", "bfloat16", "float8", ""]))
def test_commands_on_fuzzed_arguments_exit_cleanly_and_keep_the_users_files(fixtures, command, model, corpus, out,
                                                                           number, budgets, dtype):
    """Run for real: exit status 0 or 2 (one line), never a traceback, and the user's file is never modified."""
    import contextlib
    import io

    argv = {"calibrate": ["calibrate", "--model", paths(fixtures, model, "model"), "--drafter", "reused", "--corpus",
                          paths(fixtures, corpus, "corpus"), "--out", paths(fixtures, out, "calibration"), "--budgets",
                          budgets, "--frames", number, "--eval-frames", "2", "--validation-fraction", "0.3"],
            "train-offsets": ["train-offsets", "--model", paths(fixtures, model, "model"), "--corpus",
                              paths(fixtures, corpus, "corpus"), "--out", paths(fixtures, out, "run"), "--max-steps",
                              number, "--batch-size", "4", "--validation-fraction", "0.2", "--quiet", "--force"],
            "inspect": ["inspect", "--model", paths(fixtures, model, "model"), "--dtype", dtype],
            "results": ["--results", paths(fixtures, corpus, "corpus"), "--out",
                        str(Path(paths(fixtures, out, "report")) / "R.md")]}[command]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = (make_results.main if command == "results" else main)(argv)  # results: a repository tool
    event(f"{command} exit {code}")  # `pytest --hypothesis-show-statistics` shows that real runs happen too
    assert code in (0, 2), (argv, err.getvalue())
    if code == 2:
        assert err.getvalue().count("\n") == 1 and err.getvalue().startswith(("rvqspec", "make_results.py")), \
            err.getvalue()
    assert (fixtures["keep"] / "mine.txt").read_text() == "the user's"
    assert "mine.txt" in {p.name for p in fixtures["keep"].iterdir()}  # the user's file is still there
