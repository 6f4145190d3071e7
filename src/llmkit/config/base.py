"""The machinery every llmkit config shares: frozen dataclasses whose fields are type-checked on construction, a
`validate` hook with messages that name the field, and conversion to and from nested dicts (JSON, YAML).

    @dataclass(frozen=True)
    class OptimConfig(ConfigBase):
        path: ClassVar[str] = "optim"          # how errors name the section: "optim.lr=-1 must be > 0"
        lr: float = 3e-4

        def validate(self) -> None:
            self.require(self.lr > 0, "lr", "must be > 0")
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from llmkit.errors import ConfigError

C = TypeVar("C", bound="ConfigBase")


def divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _type_ok(value: Any, tp: Any) -> bool:
    """Whether `value` fits the annotation `tp` (the small subset of typing used by these configs)."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, arg) for arg in get_args(tp))
    if origin is Literal:
        return value in get_args(tp)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


class ConfigBase:
    """Shared machinery: type checks, validation hook, dict/JSON conversion."""

    path: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            tp = hints[f.name]
            if not _type_ok(value, tp):
                raise ConfigError(f"{self._name(f.name)}={value!r} has the wrong type: expected {_describe(tp)}")
            # store floats as floats so that JSON round-trips exactly
            if tp is float and isinstance(value, int):
                object.__setattr__(self, f.name, float(value))
        self.validate()

    def _name(self, field_name: str) -> str:
        return f"{self.path}.{field_name}" if self.path else field_name

    def fail(self, field_name: str, message: str) -> typing.NoReturn:
        raise ConfigError(f"{self._name(field_name)}={getattr(self, field_name)!r} {message}")

    def require(self, condition: bool, field_name: str, message: str) -> None:
        if not condition:
            self.fail(field_name, message)

    def at_least(self, minimum: float, *names: str) -> None:
        """Require each named field to be >= minimum."""
        for name in names:
            self.require(getattr(self, name) >= minimum, name, f"must be >= {minimum}")

    def within(self, low: float, high: float, *names: str) -> None:
        """Require each named field to be between low and high (inclusive), and say so when it is not."""
        for name in names:
            value = getattr(self, name)
            self.require(low <= value <= high, name, f"must be between {low:,} and {high:,}")

    def validate(self) -> None:
        """Field constraints; subclasses override."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any]) -> C:
        if not isinstance(data, dict):
            raise ConfigError(f"{cls.path or cls.__name__}: expected a mapping, got {type(data).__name__}")
        hints = get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        unknown = sorted(set(data) - set(names))
        if unknown:
            where = cls.path or "config"
            raise ConfigError(f"unknown field(s) {unknown} in {where}; valid fields: {', '.join(names)}")
        kwargs: dict[str, Any] = {}
        for name, value in data.items():
            sub = _config_class(hints[name])
            kwargs[name] = sub.from_dict(value) if sub is not None and isinstance(value, dict) else value
        try:
            return cls(**kwargs)
        except TypeError as e:  # a required field is missing
            raise ConfigError(f"{cls.path or cls.__name__}: {e}") from None

    def to_json(self, path: str | Path | None = None) -> str:
        """The config as JSON text, also written to `path` when given."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls: type[C], source: str | Path) -> C:
        """Read a config from a JSON file path or a JSON string."""
        text = str(source)
        if not text.lstrip().startswith("{"):
            p = Path(source)
            if not p.is_file():
                raise ConfigError(f"config file {str(p)!r} does not exist")
            try:
                text = p.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"config file {str(p)!r} is not UTF-8 text: {e}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config is not valid JSON: {e}") from None
        return cls.from_dict(data)


def _config_class(tp: Any) -> type[ConfigBase] | None:
    """The ConfigBase subclass inside an annotation like `MLAConfig | None`, if any."""
    candidates = get_args(tp) if get_origin(tp) in (Union, types.UnionType) else (tp,)
    for c in candidates:
        if isinstance(c, type) and issubclass(c, ConfigBase):
            return c
    return None
