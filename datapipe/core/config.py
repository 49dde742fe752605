"""Typed, strict configuration: one tree of frozen dataclasses; YAML is only how it is stored.

`from_dict(cls, data)` builds a dataclass from plain data (as YAML gives it) and refuses unknown
keys, wrong types and bad values with an error that names the dotted key, the value received and
what is allowed. Field notes live in `field(metadata={"help": ...})` so the config reference in the
README can be generated from the code.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config that cannot be used; the message names the dotted key."""


def note(default: Any = dataclasses.MISSING, help: str = "", **kwargs: Any) -> Any:
    """A dataclass field with a one-line note on its meaning and units."""
    if default is not dataclasses.MISSING and isinstance(default, (list, dict, set)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata={"help": help}, **kwargs)
    return dataclasses.field(default=default, metadata={"help": help}, **kwargs)


def from_dict(cls: type[T], data: Any, key: str = "") -> T:
    """Build dataclass `cls` from `data`, strictly. `key` is the dotted prefix for error messages."""
    return _convert(cls, data, key)


def _where(key: str) -> str:
    return f"'{key}'" if key else "the config root"


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"{_where(key)} must be a mapping, got {value!r}")
        hints = get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp) if f.init}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            bad = f"{key}.{unknown[0]}" if key else str(unknown[0])
            raise ConfigError(f"unknown config key '{bad}'; allowed: {sorted(fields)}")
        kwargs = {}
        for name, f in fields.items():
            sub = f"{key}.{name}" if key else name
            if name in value:
                kwargs[name] = _convert(hints[name], value[name], sub)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"missing required config key '{sub}'")
        try:
            return tp(**kwargs)
        except (TypeError, ValueError) as exc:
            # A __post_init__ check; its message starts with the field name, so prefix the section.
            raise ConfigError(f"{key}.{exc}" if key else str(exc)) from None
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{_where(key)}: got {value!r}; " + "; or ".join(errors))
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{_where(key)} must be one of {list(allowed)}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{_where(key)} must be a list, got {value!r}")
        (item,) = get_args(tp)[:1] or (Any,)
        items = [_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{_where(key)} must be a mapping, got {value!r}")
        ktype, vtype = get_args(tp)
        return {_convert(ktype, k, key): _convert(vtype, v, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{_where(key)} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{_where(key)} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{_where(key)} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{_where(key)} must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp!r} at {_where(key)}")


def to_dict(obj: Any) -> Any:
    """Plain data (for YAML/JSON snapshots and hashing) from a config tree."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def apply_override(data: dict, assignment: str) -> None:
    """Apply one `--set a.b.c=value` to plain config data; the value is parsed as YAML."""
    if "=" not in assignment:
        raise ConfigError(f"--set expects KEY=VALUE, got {assignment!r}")
    dotted, raw = assignment.split("=", 1)
    parts = dotted.strip().split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: '{'.'.join(parts[: i + 1])}' is not a mapping")
        node = child
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""


def read_recipe(path: str | Path | None, overrides: Iterable[str] = ()) -> tuple[dict, str]:
    """Plain data of a YAML recipe (or {} without one) with `--set` overrides applied, and a name
    for error messages (the file, or 'command line')."""
    data: dict = {}
    source = "command line"
    if path is not None:
        source = str(path)
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the config must be a mapping, got {type(data).__name__}")
    for assignment in overrides:
        apply_override(data, assignment)
    return data, source


def check(condition: bool, message: str) -> None:
    """Validate a user-supplied value (never `assert`: it vanishes under `python -O`)."""
    if not condition:
        raise ConfigError(message)


def help_lines(cls: type, prefix: str = "") -> typing.Iterator[str]:
    """Lines `key: type = default  # note` for the config reference."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield f"{key}:  # {f.metadata.get('help', '')}"
            yield from help_lines(tp, key + ".")
            continue
        item = get_args(tp)[0] if get_origin(tp) is list and get_args(tp) else None
        if item is not None and dataclasses.is_dataclass(item):
            yield f"{key}: list  # {f.metadata.get('help', '')}; each item:"
            yield from help_lines(item, key + "[].")
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = to_dict(f.default_factory())
        else:
            default = "(required)"
        if get_origin(tp) is Literal:
            tname = " | ".join(repr(a) for a in get_args(tp))
        else:
            tname = str(tp).replace("typing.", "") if get_args(tp) else getattr(tp, "__name__", str(tp))
        yield f"{key}: {tname} = {default!r}  # {f.metadata.get('help', '')}"
