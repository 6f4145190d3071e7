"""Signature -> argparse: a subcommand is a typed function; its signature becomes the flags and its docstring the help.

    def average(run: str, *, last: int = 5, out: str | None = None) -> int:
        '''Average the weights of a run's last checkpoints.

        run: a training run folder.
        last: how many of its newest checkpoints to average.
        '''

gives `llmkit average RUN [--last LAST] [--out OUT]`. Parameters before `*` are positional (optional when they have a
default); `name_` becomes `--name`; a `bool` is a switch, a `Literal` a choice, a `list[str]` a repeatable flag. A
parameter typed as a frozen dataclass is a group of options: an argument group titled with the parameter's name,
described by the dataclass's docstring, whose fields are the flags; the function receives the dataclass.

`run` reports every failure a user can act on in one line naming the path and what to do, with a non-zero exit
status and no traceback (`--debug`, or LLMKIT_DEBUG=1, shows the traceback instead): llmkit's own errors (2), the
operating system's (1: permission denied, a read-only or full disk, a missing device, a symlink loop; see
failure.py), running out of memory (1), Ctrl-C (130); a closed pipe on stdout ends it quietly (141).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import shutil
import sys
import textwrap
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from llmkit.cli.failure import describe
from llmkit.errors import LLMKitError

Command = Callable[..., int]


def command_name(fn: Command) -> str:
    """`average` -> average, `set_` -> set, `score_test` -> score-test."""
    return fn.__name__.rstrip("_").replace("_", "-")


def _docs(obj: object) -> tuple[str, dict[str, str]]:
    """The summary of a docstring and its `name: help` lines (an indented line continues the help above it)."""
    summary: list[str] = []
    helps: dict[str, str] = {}
    name: str | None = None
    for line in inspect.cleandoc(obj.__doc__ or "").splitlines():
        head, sep, rest = line.partition(":")
        if sep and head.isidentifier():
            name = head
            helps[name] = rest.strip()
        elif name is not None and line.startswith(" "):
            helps[name] += " " + line.strip()
        elif name is None:
            summary.append(line)
    return "\n".join(summary).strip(), helps


def _first_sentence(summary: str) -> str:
    text = " ".join(summary.split())
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def _unwrap_optional(tp: Any) -> Any:
    """`int | None` -> int."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _option_group(tp: Any) -> type[Any] | None:
    """The dataclass of a parameter that stands for a group of options, or None."""
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _parameters(fn: Command) -> Iterator[tuple[inspect.Parameter, Any]]:
    hints = get_type_hints(fn)
    for param in inspect.signature(fn).parameters.values():
        yield param, _unwrap_optional(hints[param.name])


def _add(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    name: str,
    tp: Any,
    default: Any,
    help_text: str,
    positional: bool = False,
) -> None:
    """One parameter or option field -> one argument."""
    kwargs: dict[str, Any] = {"help": help_text.replace("%", "%%")}
    if get_origin(tp) is Literal:
        kwargs["choices"] = list(get_args(tp))
    elif tp in (int, float, str):
        kwargs["type"] = tp
    elif get_origin(tp) is list:  # a repeatable flag
        kwargs["action"] = "append"
        kwargs["type"] = get_args(tp)[0]
    elif tp is bool:
        kwargs["action"] = "store_true"
    else:
        raise TypeError(f"{name}: the command line has no flag for {tp!r}")
    if positional:
        if default is not inspect.Parameter.empty:
            kwargs.update(nargs="?", default=default)
        parser.add_argument(name, **kwargs)
    else:
        if "type" in kwargs:
            kwargs["metavar"] = name.rstrip("_").upper()  # --set SET, not SET_
        parser.add_argument("--" + name.rstrip("_").replace("_", "-"), dest=name, default=default, **kwargs)


def _add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser], fn: Command) -> None:
    summary, helps = _docs(fn)
    parser = sub.add_parser(command_name(fn), description=summary)
    # after the command too; SUPPRESS keeps `llmkit --debug CMD`'s value when it is not repeated here
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    for param, tp in _parameters(fn):
        group = _option_group(tp)
        if group is None:
            positional = param.kind is param.POSITIONAL_OR_KEYWORD
            _add(parser, param.name, tp, param.default, helps.get(param.name, ""), positional)
            continue
        description, field_helps = _docs(group)
        section = parser.add_argument_group(param.name.rstrip("_").replace("_", " "), description)
        hints = get_type_hints(group)
        for field in dataclasses.fields(group):
            if field.default is dataclasses.MISSING:
                raise TypeError(f"{group.__name__}.{field.name} needs a default: it is the flag's default")
            tp = _unwrap_optional(hints[field.name])
            _add(section, field.name, tp, field.default, field_helps.get(field.name, ""))
    parser.set_defaults(_fn=fn)


def _overview(commands: Sequence[Command]) -> str:
    """The commands, one line each, under the name of the module that holds them (models, data, training, ...)."""
    width = max(len(command_name(fn)) for fn in commands) + 4
    columns = max(shutil.get_terminal_size().columns - 2, 40)
    sections: dict[str, list[str]] = {}
    for fn in commands:
        line = f"  {command_name(fn):<{width - 2}}" + _first_sentence(_docs(fn)[0])
        wrapped = textwrap.fill(line, columns, subsequent_indent=" " * width)
        sections.setdefault(fn.__module__.rpartition(".")[2], []).append(wrapped)
    return "\n\n".join(f"{title}:\n" + "\n".join(lines) for title, lines in sections.items())


_DEBUG_HELP = "show the traceback of a failure instead of its one-line message (also LLMKIT_DEBUG=1)"


def build_parser(commands: Sequence[Command]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmkit",
        description="The Transformer family, readable and tested.",
        epilog=_overview(commands),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="one of the commands below")
    for fn in commands:
        _add_command(sub, fn)
    return parser


def _arguments(fn: Command, values: dict[str, Any]) -> dict[str, Any]:
    """The parsed flags -> fn's keyword arguments, option groups gathered into their dataclasses."""
    kwargs = {}
    for param, tp in _parameters(fn):
        group = _option_group(tp)
        if group is None:
            kwargs[param.name] = values[param.name]
        else:
            kwargs[param.name] = group(**{f.name: values[f.name] for f in dataclasses.fields(group)})
    return kwargs


def run(commands: Sequence[Command], argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run its command; a failure is reported on one line (see the module docstring)."""
    args = build_parser(commands).parse_args(argv)
    debug = args.debug or os.environ.get("LLMKIT_DEBUG", "") not in ("", "0")
    try:
        return int(args._fn(**_arguments(args._fn, vars(args))))
    except LLMKitError as e:
        if debug:
            raise
        print(f"llmkit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"llmkit {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`llmkit generate ... | head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not fail again
        return 141
    except Exception as e:
        message = describe(e)
        if debug or message is None:
            raise
        print(f"llmkit {args.command}: error: {message} (--debug shows the traceback)", file=sys.stderr)
        return 1
