"""The `llmkit` command line. Each subcommand is a typed function: its signature becomes the flags and its docstring
the help (parameters before `*` are positional; `name_` becomes `--name`).

    llmkit presets                          list the named presets
    llmkit inspect PRESET_OR_CONFIG [--json] [--seq-len N] [--dtype fp32|bf16|fp16]
    llmkit inspect --compare llama2-7b,mixtral-8x7b,deepseek-v3
"""

from __future__ import annotations

import argparse
import inspect as pyinspect
import json
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from llmkit.config import ModelConfig
from llmkit.errors import LLMKitError

COMMANDS: dict[str, Callable[..., int]] = {}


def command(fn: Callable[..., int]) -> Callable[..., int]:
    """Register a function as a subcommand named after it."""
    COMMANDS[fn.__name__.rstrip("_").replace("_", "-")] = fn
    return fn


# ---- commands


def _load_config(spec: str) -> tuple[str, ModelConfig]:
    from llmkit.presets import get_preset

    if spec.endswith(".json") or Path(spec).is_file():
        return Path(spec).stem, ModelConfig.from_json(Path(spec))
    return spec, get_preset(spec)


@command
def presets(*, json_: bool = False) -> int:
    """List the named presets with their parameter counts and sources.

    json_: print a JSON list instead of a table.
    """
    from llmkit.analysis import analyze, human
    from llmkit.presets import PRESETS

    rows: list[dict[str, Any]] = []
    for name, p in PRESETS.items():
        report = analyze(p.config, name)
        rows.append(
            {
                "name": name,
                "params_total": report.params_total,
                "params_active": report.params_active,
                "architecture": report.architecture,
                "attention": p.config.attention.kind,
                "source": p.source,
            }
        )
    if json_:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    print(f"{'preset':<{width}}  {'total':>8}  {'active':>8}  {'attention':<9}  source")
    for r in rows:
        print(
            f"{r['name']:<{width}}  {human(r['params_total']):>8}  {human(r['params_active']):>8}  "
            f"{r['attention']:<9}  {r['source']}"
        )
    return 0


@command
def inspect(
    model: str | None = None,
    *,
    json_: bool = False,
    seq_len: int | None = None,
    dtype: Literal["fp32", "bf16", "fp16"] = "bf16",
    compare: str | None = None,
) -> int:
    """Parameters (total, active, by component), weight memory, KV cache and FLOPs of a preset or config file.

    model: a preset name (see `llmkit presets`) or a ModelConfig JSON file.
    json_: print one JSON object (with --compare, a list).
    seq_len: context length for the KV-cache size and FLOPs (default: the model's max_seq_len; 4096 with --compare).
    dtype: element type for weight and cache bytes.
    compare: comma-separated presets or config files to show side by side.
    """
    from llmkit.analysis import analyze, format_compare, format_report

    if compare is None and model is None:
        raise LLMKitError("give a preset or config file to inspect, or --compare A,B,...")
    if compare is not None:
        specs = [s.strip() for s in compare.split(",") if s.strip()]
        if model is not None:
            specs.insert(0, model)
        if not specs:
            raise LLMKitError(f"--compare {compare!r} names no model; give comma-separated presets or config files")
        length = 4096 if seq_len is None else seq_len
        reports = [analyze(cfg, name, length, dtype) for name, cfg in map(_load_config, specs)]
        print(json.dumps([r.to_dict() for r in reports], indent=2) if json_ else format_compare(reports))
        return 0
    assert model is not None
    name, cfg = _load_config(model)
    report = analyze(cfg, name, seq_len, dtype)
    print(json.dumps(report.to_dict(), indent=2) if json_ else format_report(report))
    return 0


# ---- signature -> argparse


def _param_docs(doc: str) -> tuple[str, dict[str, str]]:
    """Summary paragraph and `name: help` lines of a docstring."""
    summary, helps = [], {}
    for line in pyinspect.cleandoc(doc or "").splitlines():
        head, sep, rest = line.partition(":")
        if sep and head.strip().isidentifier() and " " not in head.strip():
            helps[head.strip()] = rest.strip()
        elif not helps:
            summary.append(line)
    return "\n".join(summary).strip(), helps


def _scalar(tp: Any) -> tuple[Any, bool]:
    """(underlying type, optional) of an annotation like `int | None`."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0], len(args) < len(get_args(tp))
    return tp, False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmkit", description="The Transformer family, readable and tested.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn in COMMANDS.items():
        summary, helps = _param_docs(fn.__doc__ or "")
        p = sub.add_parser(name, help=summary.splitlines()[0] if summary else "", description=summary)
        hints = get_type_hints(fn)
        for pname, param in pyinspect.signature(fn).parameters.items():
            tp, _ = _scalar(hints[pname])
            help_text = helps.get(pname, "")
            kwargs: dict[str, Any] = {"help": help_text}
            if get_origin(tp) is Literal:
                kwargs["choices"] = list(get_args(tp))
            elif tp in (int, float, str):
                kwargs["type"] = tp
            if param.kind is param.POSITIONAL_OR_KEYWORD:
                if param.default is not param.empty:
                    kwargs["nargs"] = "?"
                    kwargs["default"] = param.default
                p.add_argument(pname, **kwargs)
                continue
            flag = "--" + pname.rstrip("_").replace("_", "-")
            if tp is bool:
                p.add_argument(flag, dest=pname, action="store_true", default=param.default, help=help_text)
            else:
                p.add_argument(flag, dest=pname, default=param.default, **kwargs)
        p.set_defaults(_fn=fn)
    return parser


def main(argv: typing.Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fn = args._fn
    kwargs = {k: v for k, v in vars(args).items() if k not in ("_fn", "command")}
    try:
        return fn(**kwargs)
    except LLMKitError as e:
        print(f"llmkit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
