"""config.json <-> ModelConfig as two-way field tables.

A family declares its config.json once, as a table of entries, and both directions walk the same table:

    Field("attention.n_heads", "num_attention_heads", int)     one config.json key <-> one llmkit config path
    Field("norm.eps", "rms_norm_eps", float, 1e-6)             ... with the value llmkit takes when the key is absent
    Fixed("norm.kind", "rmsnorm", why)                          what the family always is: set on read, checked on write
    Stated("scoring_func", "sigmoid", why)                      a config.json key with one supported value
    Derived("qk_head_dim", lambda cfg: cfg.head_dim)            a key transformers needs that follows from the rest
    Assumed("init", "xavier")                                   a training setting config.json does not hold
    Custom(read, write)                                         what is not one key (RoPE scaling, sliding windows)

Reading fills a nested dict and hands it to `ModelConfig.from_dict`, which validates it. Writing first checks every
`Fixed` value (a model not of the family's shape is refused, naming each field and why), then resolves the config
(derived sizes written out) and asks each entry for its part of config.json. An entry limited to some model_types
(`only=("qwen2",)`) is how the model_types of one family differ: Llama has one `attention_bias` flag, Qwen2 biases
q, k and v but never o.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmkit.config import ModelConfig
from llmkit.errors import ConfigError
from llmkit.interop.keymap import as_tuple

HFConfig = Mapping[str, Any]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # a Field default: the key must be present


def same(value: Any) -> Any:
    return value


def optional_positive(value: Any) -> int | None:
    """A size where 0 or null means "none" (Mistral's sliding_window, DeepSeek's q_lora_rank)."""
    return int(value) if value else None


def require(hf: HFConfig, key: str) -> Any:
    """hf[key], or a ConfigError saying that the checkpoint's config.json lacks it."""
    if hf.get(key) is None:
        raise ConfigError(f"config.json has no {key!r}, which a {hf.get('model_type')} checkpoint needs")
    return hf[key]


def _shown(value: Any) -> str:
    return f"<{type(value).__name__}>" if dataclasses.is_dataclass(value) else repr(value)


def _lookup(cfg: ModelConfig, path: str) -> tuple[str, Any]:
    """(path, cfg.attention.mla.kv_lora_rank) for path "attention.mla.kv_lora_rank", or (the sub-config's path,
    None) when a sub-config on the way is None (moe, for a dense model)."""
    value: Any = cfg
    parts = path.split(".")
    for depth, part in enumerate(parts):
        if value is None:
            return ".".join(parts[:depth]), None
        value = getattr(value, part)
    return path, value


def get_path(cfg: ModelConfig, path: str, model_type: str) -> Any:
    """The value at `path` in `cfg`; a ConfigError when a sub-config on the way is None."""
    reached, value = _lookup(cfg, path)
    if reached != path:
        raise ConfigError(f"{reached} is None, but model_type {model_type!r} needs it (for {path})")
    return value


def _set_path(nested: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        nested = nested.setdefault(part, {})
    nested[last] = value


def _merge(out: dict[str, Any], part: Mapping[str, Any]) -> None:
    """Add one entry's config.json keys; a dict value (rope_parameters) is merged with what is already there."""
    for key, value in part.items():
        old = out.get(key)
        out[key] = {**old, **value} if isinstance(old, dict) and isinstance(value, dict) else value


def differences(ours: Mapping[str, Any], back: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(path, ours, back) for every leaf where two nested config dicts differ."""
    out = []
    for key in ours:
        a, b = ours[key], back.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append((f"{prefix}{key}", a, b))
    return out


# ---- entries


@dataclass(frozen=True)
class Entry(abc.ABC):
    """One row of a family's table. `only`: the model_types it applies to (empty: all of the family's)."""

    only: tuple[str, ...] = field(default=(), kw_only=True)

    def applies(self, model_type: str) -> bool:
        return not self.only or model_type in self.only

    @abc.abstractmethod
    def read(self, hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
        """llmkit config paths -> values, from config.json (and the checkpoint's tensor names)."""

    def unsupported(self, hf: HFConfig) -> str | None:
        """Why llmkit cannot read this config.json, or None. Only `Stated` entries refuse a config.json; the others
        convert what they find."""
        return None

    def refusal(self, cfg: ModelConfig, model_type: str) -> tuple[str, str] | None:
        """(the field as `cfg` has it, why `model_type` cannot hold it), or None when it fits. Only `Fixed` entries
        refuse a config; the others convert what they find."""
        return None

    @abc.abstractmethod
    def write(self, cfg: ModelConfig, model_type: str) -> dict[str, Any]:
        """config.json keys -> values, from a resolved config."""


@dataclass(frozen=True)
class Field(Entry):
    """config.json key(s) <-> llmkit path(s). Several paths: they share one key and must agree when written (Llama's
    attention_bias covers q, k, v and o). Several keys: they must agree when read and are all written (Marian's
    encoder_ffn_dim and decoder_ffn_dim). `default` is the llmkit value taken when the key is absent or null."""

    ours: str | tuple[str, ...]
    theirs: str | tuple[str, ...]
    to_ours: Callable[[Any], Any] = same
    default: Any = REQUIRED
    to_theirs: Callable[[Any], Any] = same

    def read(self, hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
        present = [(k, hf[k]) for k in as_tuple(self.theirs) if hf.get(k) is not None]
        if not present:
            if self.default is REQUIRED:
                require(hf, as_tuple(self.theirs)[0])
            return dict.fromkeys(as_tuple(self.ours), self.default)
        key, raw = present[0]
        for other, value in present[1:]:
            if value != raw:
                raise ConfigError(
                    f"config.json {key}={raw!r} differs from {other}={value!r}, which llmkit does not support "
                    f"(it has one {self.ours} for both)"
                )
        try:
            value = self.to_ours(raw)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.json {key}={raw!r} is not supported; {e}") from None
        return dict.fromkeys(as_tuple(self.ours), value)

    def write(self, cfg: ModelConfig, model_type: str) -> dict[str, Any]:
        paths = as_tuple(self.ours)
        values = [get_path(cfg, p, model_type) for p in paths]
        if any(v != values[0] for v in values[1:]):
            shown = " and ".join(f"{p}={v!r}" for p, v in zip(paths, values, strict=True))
            raise ConfigError(
                f"{shown} cannot be written as model_type {model_type!r}: its config.json has one {self.theirs} "
                "for all of them"
            )
        return dict.fromkeys(as_tuple(self.theirs), self.to_theirs(values[0]))


@dataclass(frozen=True)
class Fixed(Entry):
    """A value every checkpoint of the family (or model_type) has: set when reading, checked before writing."""

    ours: str
    value: Any
    why: str

    def read(self, hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
        return {self.ours: self.value}

    def refusal(self, cfg: ModelConfig, model_type: str) -> tuple[str, str] | None:
        reached, actual = _lookup(cfg, self.ours)
        if reached == self.ours and actual == self.value:
            return None
        return f"{reached}={_shown(actual)}", self.why

    def write(self, cfg: ModelConfig, model_type: str) -> dict[str, Any]:
        return {}


def fixed(why: str, values: Mapping[str, Any], only: tuple[str, ...] = ()) -> tuple[Fixed, ...]:
    """Several Fixed entries that share one reason."""
    return tuple(Fixed(path, value, why, only=only) for path, value in values.items())


@dataclass(frozen=True)
class Stated(Entry):
    """A config.json key with the one value llmkit supports: refused when read with another value, always written."""

    theirs: str
    value: Any
    why: str

    def unsupported(self, hf: HFConfig) -> str | None:
        actual = hf.get(self.theirs)
        if actual is None or actual == self.value:
            return None
        return f"config.json {self.theirs}={actual!r} is not supported: {self.why}"

    def read(self, hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
        return {}

    def write(self, cfg: ModelConfig, model_type: str) -> dict[str, Any]:
        return {self.theirs: self.value}


@dataclass(frozen=True)
class Derived(Entry):
    """A config.json key transformers reads that follows from the rest of the config: written, not read."""

    theirs: str
    compute: Callable[[ModelConfig], Any]

    def read(self, hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
        return {}

    def write(self, cfg: ModelConfig, model_type: str) -> dict[str, Any]:
        return {self.theirs: self.compute(cfg)}


@dataclass(frozen=True)
class Assumed(Entry):
    """A training setting config.json does not hold (the initialisation, the balance loss): set when reading to what
    the family was trained with, not written. `ModelConfig.architecture()` ignores these settings, so they never
    block a write."""

    ours: str
    value: Any

    def read(self, hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
        return {self.ours: self.value}

    def write(self, cfg: ModelConfig, model_type: str) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class Custom(Entry):
    """A conversion that is not one key, as two named functions: `from_hf` gives llmkit paths -> values (it may look
    at the checkpoint's tensor names), `to_hf` gives config.json keys -> values and raises ConfigError for what
    config.json cannot express."""

    from_hf: Callable[[HFConfig, Collection[str]], dict[str, Any]]
    to_hf: Callable[[ModelConfig], dict[str, Any]]

    def read(self, hf: HFConfig, names: Collection[str]) -> dict[str, Any]:
        return self.from_hf(hf, names)

    def write(self, cfg: ModelConfig, model_type: str) -> dict[str, Any]:
        return self.to_hf(cfg)


# ---- whole tables


def read_fields(table: Iterable[Entry], hf: HFConfig, names: Collection[str], model_type: str) -> ModelConfig:
    """The ModelConfig a `model_type` config.json describes, by `table`; a ConfigError naming every option llmkit
    does not support."""
    entries = [e for e in table if e.applies(model_type)]
    unsupported = [why for e in entries if (why := e.unsupported(hf)) is not None]
    if unsupported:
        raise ConfigError("; ".join(unsupported))
    nested: dict[str, Any] = {}
    for entry in entries:
        for path, value in entry.read(hf, names).items():
            _set_path(nested, path, value)
    return ModelConfig.from_dict(nested)


def write_fields(table: Iterable[Entry], cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """The config.json keys `table` writes for `cfg` as `model_type`; a ConfigError naming every field that does not
    fit, and why."""
    entries = [e for e in table if e.applies(model_type)]
    refused: dict[str, dict[str, None]] = {}  # why -> the fields it refuses, in table order
    for entry in entries:
        if (refusal := entry.refusal(cfg, model_type)) is not None:
            refused.setdefault(refusal[1], {})[refusal[0]] = None
    if refused:
        raise ConfigError(
            "; ".join(
                f"{', '.join(shown)} cannot be written as model_type {model_type!r}: {why}"
                for why, shown in refused.items()
            )
        )
    resolved = cfg.resolved()
    out: dict[str, Any] = {}
    for entry in entries:
        _merge(out, entry.write(resolved, model_type))
    return out
