"""The command table: every command's options as they were recorded (flags, defaults, types,
choices) and the signature reading that makes them."""

import argparse
import json
from pathlib import Path
from typing import Annotated

import pytest

from tformer.arguments import Help, add_arguments, call
from tformer.cli import COMMANDS, build_parser, main

RECORDED = Path(__file__).with_name("options.json")


def describe(parser: argparse.ArgumentParser) -> list[dict]:
    rows = []
    for a in parser._actions:
        if isinstance(a, (argparse._SubParsersAction, argparse._HelpAction)):
            continue
        rows.append({
            "flags": list(a.option_strings) or [a.dest], "default": a.default,
            "nargs": a.nargs, "choices": list(a.choices) if a.choices else None,
            "required": a.required, "type": getattr(a.type, "__name__", None),
            "kind": type(a).__name__,
        })
    return rows


def test_every_command_takes_the_recorded_options_with_their_defaults():
    recorded = json.loads(RECORDED.read_text())
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert describe(parser) == recorded["tformer"]
    assert sorted(commands.choices) == sorted(recorded["commands"]) == sorted(COMMANDS)
    for name, sub in commands.choices.items():
        assert describe(sub) == recorded["commands"][name], name
    assert {a.dest: a.help for a in commands._choices_actions} == recorded["help"]


def test_help_names_every_command_without_importing_them(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, command in COMMANDS.items():
        assert name in out and command.summary.split()[0] in out


def test_a_command_help_shows_its_defaults(capsys):
    assert main(["generate", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "tokens to add (default: 200)" in out and "--no-cache" in out


def example(
    path: Annotated[str, Help("a path")],
    extra: Annotated[list[str] | None, Help("more", nargs="*")] = None,
    *,
    count: Annotated[int, Help("how many")] = 3,
    ratio: Annotated[float | None, Help("a ratio")] = None,
    fast: Annotated[bool, Help("go fast")] = False,
    tag: Annotated[list[str] | None, Help("tags", repeat=True)] = None,
    out: Annotated[str, Help("where", flags=("-o", "--out"))],
) -> int:
    return {"path": path, "extra": extra, "count": count, "ratio": ratio, "fast": fast,
            "tag": tag, "out": out}  # type: ignore[return-value]


def test_a_signature_becomes_options_and_the_values_come_back():
    parser = argparse.ArgumentParser()
    add_arguments(parser, example)
    args = parser.parse_args(["p", "x", "y", "--count", "5", "--fast", "--tag", "a",
                              "--tag", "b", "-o", "o.txt", "--ratio", "0.5"])
    assert call(example, args) == {"path": "p", "extra": ["x", "y"], "count": 5,
                                   "ratio": 0.5, "fast": True, "tag": ["a", "b"],
                                   "out": "o.txt"}
    args = parser.parse_args(["p", "--out", "o"])
    assert call(example, args) == {"path": "p", "extra": [], "count": 3, "ratio": None,
                                   "fast": False, "tag": None, "out": "o"}
    with pytest.raises(SystemExit):  # --out has no default: it is required
        parser.parse_args(["p"])


def test_a_parameter_without_help_is_a_programming_error():
    def bare(path: str) -> int:
        return 0

    with pytest.raises(TypeError, match="Annotated"):
        add_arguments(argparse.ArgumentParser(), bare)


def test_an_unknown_weight_format_is_one_line_naming_the_known_ones(capsys):
    assert main(["generate", "ckpt", "--weights", "int3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    from tformer.kernels.formats import FORMATS, MIXES

    known = ", ".join(repr(name) for name in (*FORMATS, *MIXES))
    assert f"--weights: invalid choice: 'int3' (choose from {known})" in err[0]
