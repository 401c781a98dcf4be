"""The `tformer` command: one table of subcommands (COMMANDS), each a typed function.

Each command lives beside what it runs, and COMMANDS names its module: train, generate,
evaluate, translate and average in tformer/cli/; serve in tformer/serving/command.py; plot,
info and attention in tformer/viz/command.py; import and export in
tformer/interop/command.py. A command's options are its function's parameters
(tformer/arguments.py reads them). The command modules own the terminal (progress bars,
tables, streamed text), the seeds and the device; the library only logs. A TformerError
becomes one line on stderr and exit code 2; Ctrl-C at any moment, the imports included, is
one line and exit code 130.

Nothing heavy is imported before `main` runs: only the chosen command's module is imported,
after the interrupt handler is in place.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    function: str
    """"module:function", the typed function whose parameters are the command's options."""
    summary: str
    """The one line `tformer --help` shows for it."""
    preload: tuple[str, ...] = ("torch", "tformer.registry", "tformer.loading")
    """Modules imported before the command runs, while Ctrl-C still leaves at once: a
    KeyboardInterrupt raised inside an extension's initialisation (torch's pybind11 code)
    aborts the process instead of unwinding."""


COMMANDS: dict[str, Command] = {
    "train": Command("tformer.cli.train:train", "train a model from a TOML config"),
    "generate": Command("tformer.cli.generate:generate", "sample text from a language model"),
    "evaluate": Command("tformer.cli.evaluate:evaluate",
                        "loss, perplexity and bits per character"),
    "chat": Command("tformer.cli.chat:chat",
                    "a conversation with a chat model in the terminal"),
    "translate": Command("tformer.cli.translate:translate",
                         "translate lines with a seq2seq model"),
    "serve": Command("tformer.serving.command:serve_command",
                     "serve a model over HTTP (OpenAI-style completions, translations)"),
    "average": Command("tformer.cli.average:average",
                       "average the weights of several checkpoints"),
    "plot": Command("tformer.viz.command:plot_command",
                    "plot the loss, learning rate and speed of runs",
                    preload=("matplotlib.figure",)),
    "info": Command("tformer.viz.command:info_command",
                    "a checkpoint's config, parameters, FLOPs and memory"),
    "attention": Command("tformer.viz.command:attention_command",
                         "draw attention maps (layers x heads) for one text",
                         preload=("torch", "tformer.registry", "tformer.loading",
                                  "matplotlib.figure")),
    "import": Command("tformer.interop.command:import_command",
                      "a local Hugging Face model directory or GGUF file -> a checkpoint"),
    "export": Command("tformer.interop.command:export_command",
                      "a checkpoint -> a Hugging Face model directory or GGUF file"),
}


def command_function(name: str) -> Callable[..., int]:
    module, function = COMMANDS[name].function.split(":")
    return getattr(importlib.import_module(module), function)


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line and exit code 2 (argparse's default code)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


class CommandParser(Parser):
    """A subcommand's parser: options and file arguments in any order (`translate CKPT
    --int8 input.en -o out`), which plain argparse stops reading at the first option that
    follows a positional. argparse calls parse_known_args for a subcommand; it becomes the
    intermixed parse, which itself calls parse_known_args twice (hence the guard)."""

    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        if self._intermixing:
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


class DefaultsFormatter(argparse.HelpFormatter):
    """--help gives each option's default, where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and "default" not in text
            and not any(default is v for v in (None, False, "", argparse.SUPPRESS))
        ):
            text += f" (default: {default})"
        return text


def build_parser(commands: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of `tformer`, with the options of the named commands, or of all of them
    (a command not named shows in --help by its name and summary; its module is not
    imported)."""
    from tformer import __version__
    from tformer.arguments import add_arguments

    parser = Parser(prog="tformer", description="train, evaluate and run the translation "
                    "Transformer, GPT and Transformer-XL")
    parser.add_argument("--version", action="version", version=f"tformer {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, formatter_class=DefaultsFormatter, help=command.summary)
        if commands is None or name in commands:
            add_arguments(p, command_function(name))
    return parser


def chosen_command(argv: list[str]) -> str | None:
    """The subcommand named on the command line: its first word that is not an option
    (the options before it, -v, --version and --help, take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def _interrupted(signum: int, frame: object) -> None:
    """Ctrl-C before a command is under way (while torch and the model load): nothing to
    save yet, so leave at once, as shells expect of an interrupted command."""
    print("tformer: interrupted", file=sys.stderr, flush=True)
    os._exit(130)


def main(argv: list[str] | None = None) -> int:
    from_shell = argv is None
    if from_shell and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted)
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _main(argv, from_shell)
    except KeyboardInterrupt:
        print("tformer: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str], from_shell: bool) -> int:
    from tformer.arguments import call
    from tformer.errors import TformerError

    name = chosen_command(argv)
    parser = build_parser([name] if name in COMMANDS else [])
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors (code 2), --help and --version (code 0)
        return e.code if isinstance(e.code, int) else 0
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s: %(message)s",
    )
    function = command_function(args.command)
    for module in COMMANDS[args.command].preload:
        try:
            importlib.import_module(module)
        except ImportError:
            pass  # a missing extra: the command says so itself, in one line
    if from_shell:  # from here on a command saves what it must (training's own handler)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return call(function, args)
    except TformerError as e:
        print(f"tformer: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
