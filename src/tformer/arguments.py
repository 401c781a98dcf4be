"""A command's options, read from its function's signature, so that each is written once:
a parameter's name is its flag, its annotation its type and help, its default the default.

    def generate(
        checkpoint: Annotated[str, Help("run or checkpoint directory")],   # positional
        *,
        max_new_tokens: Annotated[int, Help("tokens to add")] = 200,        # --max-new-tokens
        greedy: Annotated[bool, Help("same as --temperature 0")] = False,   # a switch
    ) -> int:

Parameters before the `*` are positional arguments; keyword-only ones are options. A bool is
a switch that defaults to False; `list[str]` with `repeat` collects a repeated option.
"""

from __future__ import annotations

import argparse
import inspect
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Help:
    """What argparse needs beyond a parameter's name, type and default."""

    text: str
    flags: tuple[str, ...] = ()
    """The option's spellings, where they are not --the-parameter-name (`("-o", "--output")`)."""
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    nargs: str | None = None
    """For positionals: "?" optional, "*" any number, "+" at least one."""
    repeat: bool = False
    """An option that may be given more than once; the value is the list of them."""
    one_of: str | None = None
    """Options with the same `one_of` are a required, mutually exclusive group."""
    alias: tuple[str, str] | None = None
    """(flag, value): a switch that gives the option this value (`("--int8", "int8")`)."""


@dataclass(frozen=True)
class Gathered:
    """A parameter whose value is put together from options that only the running program
    knows (the families' own evaluate options): `add` adds them, `read` reads them back."""

    add: Callable[[argparse.ArgumentParser], None]
    read: Callable[[argparse.Namespace], Any]


def add_arguments(parser: argparse.ArgumentParser, function: Callable[..., int]) -> None:
    """Give `parser` one argument per parameter of `function`."""
    hints = typing.get_type_hints(function, include_extras=True)
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for param in inspect.signature(function).parameters.values():
        kind, meta = _split(hints[param.name])
        if isinstance(meta, Gathered):
            meta.add(parser)
            continue
        required = param.default is inspect.Parameter.empty
        options: dict[str, Any] = {"help": meta.text}
        if meta.metavar is not None:
            options["metavar"] = meta.metavar
        if meta.choices is not None:
            options["choices"] = meta.choices
        if kind is not str and kind is not bool:
            options["type"] = kind
        if param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            if meta.nargs is not None:
                options["nargs"] = meta.nargs
            if not required and not (meta.nargs == "*" and param.default is None):
                options["default"] = param.default  # ("*" takes none: [] then, as argparse does)
            parser.add_argument(param.name, **options)
            continue
        flags = meta.flags or ("--" + param.name.replace("_", "-"),)
        options["dest"] = param.name
        if kind is bool:
            options.pop("type", None)
            options["action"] = "store_true"
        else:
            options["default"] = param.default if not required else None
            if meta.repeat:
                options["action"] = "append"
            if required and meta.one_of is None:
                options["required"] = True
        target: Any = parser
        if meta.one_of is not None:
            if meta.one_of not in groups:
                groups[meta.one_of] = parser.add_mutually_exclusive_group(required=True)
            target = groups[meta.one_of]
        target.add_argument(*flags, **options)
        if meta.alias is not None:
            flag, value = meta.alias
            target.add_argument(flag, dest=param.name, action="store_const", const=value,
                                help=f"the same as {flags[-1]} {value}")


def call(function: Callable[..., int], args: argparse.Namespace) -> int:
    """Run `function` with the values parsed for its parameters."""
    hints = typing.get_type_hints(function, include_extras=True)
    values = {}
    for name in inspect.signature(function).parameters:
        _, meta = _split(hints[name])
        values[name] = meta.read(args) if isinstance(meta, Gathered) else getattr(args, name)
    return function(**values)


def _split(hint: Any) -> tuple[type, Help | Gathered]:
    """Annotated[T, Help(...)] -> (the scalar type argparse converts to, the Help)."""
    if typing.get_origin(hint) is not typing.Annotated:
        raise TypeError(f"a command's parameter needs Annotated[type, Help(...)], not {hint}")
    base, meta = hint.__origin__, hint.__metadata__[0]
    if typing.get_origin(base) in (typing.Union, types.UnionType):
        base = next(a for a in typing.get_args(base) if a is not type(None))
    if typing.get_origin(base) is list:
        (base,) = typing.get_args(base)
    return base, meta
