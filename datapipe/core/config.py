"""Typed, strict configuration: one tree of frozen dataclasses; YAML is only how it is stored.

Every command's config (curate, curate-preferences, train) is a root dataclass loaded by the one
loader, `load(Root, recipe, overrides, flags)`: read the YAML recipe, apply the `--set a.b=v`
overrides, apply the command-line flags, build the tree strictly. `from_dict(cls, data)` refuses
unknown keys, wrong types and bad values with a `ConfigError` that names the dotted key, the value
received and what is allowed; the loader prefixes the `--set` that gave that key its value, else the
recipe file. A dataclass may list renamed keys in a `RENAMED: ClassVar[dict[str, str]]` (old dotted
key -> new); an old key is an error naming the new one. Field notes live in `note(help=...)` so
`datapipe config-reference` is generated from the code.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config or an input that cannot be used; the message names the dotted key (or the path) and the fix.
    The CLI prints it as one paragraph, without a traceback, and exits 2."""


class RunStopped(RuntimeError):
    """A run that stopped on purpose for a reason the user must act on (e.g. the loss diverged); the message
    says which. The CLI prints it without a traceback and exits 1."""


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


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _holds(data: Any, parts: list[str]) -> bool:
    """Whether plain data holds the dotted key `parts` (mappings only)."""
    for part in parts:
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


# YAML 1.1 (PyYAML) reads 1e-3 as a string; YAML 1.2 and every user read it as a number.
_NUMBER = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")


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
        for old, new in getattr(tp, "RENAMED", {}).items():
            if _holds(value, old.split(".")):
                raise ConfigError(f"config key '{_join(key, old)}' was renamed to '{_join(key, new)}'; use the new name")
        unknown = sorted(set(value) - set(fields), key=str)
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
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            return float(value)
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


def set_key(data: dict, dotted: str, value: Any, what: str) -> None:
    """Set the dotted key `a.b.c` of plain config data to `value`, creating missing mappings; a numeric part
    indexes a list (`inputs.0.domain_field`). `what` names the setting in errors (e.g. '--set a.b')."""
    parts = dotted.strip().split(".")
    if not all(p.strip() for p in parts):
        raise ConfigError(f"{what}: {dotted!r} is not a dotted key such as 'dedup.exact.enabled'")
    node: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        where = ".".join(parts[:i]) or "the config root"
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"{what}: '{where}' is a list of {len(node)} item(s); {part!r} is not an index of it")
            part = int(part)
        elif not isinstance(node, dict):
            raise ConfigError(f"{what}: '{where}' is not a mapping")
        if last:
            node[part] = value
        else:
            if isinstance(node, dict) and node.get(part) is None:
                node[part] = {}
            node = node[part]


def apply_override(data: dict, assignment: str) -> None:
    """Apply one `--set a.b.c=value` to plain config data; the value is parsed as YAML."""
    if "=" not in assignment:
        raise ConfigError(f"--set expects KEY=VALUE, got {assignment!r}")
    dotted, raw = assignment.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {dotted.strip()}: the value {raw!r} is not valid YAML: {_yaml_problem(exc)}; "
                          "quote it to pass a string") from None
    set_key(data, dotted, value, f"--set {dotted.strip()}")


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML syntax error on one line: what is wrong and where (PyYAML's own text spans several lines)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        text = f"{exc.problem} at line {mark.line + 1}, column {mark.column + 1}"
        if exc.context:
            text += f", {exc.context}"
            text += f" from line {exc.context_mark.line + 1}" if exc.context_mark is not None else ""
        return text
    return " ".join(str(exc).split())


def read_recipe(path: str | Path | None, overrides: Iterable[str] = ()) -> tuple[dict, str]:
    """Plain data of a YAML recipe (or {} without one) with `--set` overrides applied, and a name
    for error messages (the file, or 'command line')."""
    data: dict = {}
    source = "command line"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except IsADirectoryError:
            raise ConfigError(f"{path} is a folder; the config must be a YAML file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the config file {path}: {getattr(exc, 'strerror', None) or exc}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(exc)}") from None
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the config must be a mapping of keys to values, got {type(data).__name__}")
    for assignment in overrides:
        apply_override(data, assignment)
    return data, source


def load(root: type[T], path: str | Path | None, overrides: Iterable[str] = (),
         flags: Mapping[str, Any | Callable[[dict], Any]] | None = None) -> T:
    """The one loader of every command's config: read the YAML recipe at `path` (None: start empty), apply the
    `--set KEY=VALUE` overrides, then the command-line flags, and build `root` strictly.

    `flags` maps a dotted key to a flag's value; None means the flag was not given. A callable value is called
    with the recipe data (after the overrides) and returns the value (for flags that inherit from the recipe).
    Every error is a ConfigError naming the dotted key, prefixed with the `--set` that gave the key its value,
    else with the recipe file (or 'command line')."""
    overrides = list(overrides)
    data, source = read_recipe(path, overrides)
    try:
        for dotted, value in (flags or {}).items():
            if value is not None:
                set_key(data, dotted, value(data) if callable(value) else value, f"the flag for {dotted}")
        return from_dict(root, data)
    except ConfigError as exc:
        raise ConfigError(f"{_blamed(str(exc), overrides) or source}: {exc}") from None


def _blamed(message: str, overrides: list[str]) -> str | None:
    """'--set KEY=VALUE' of the last override whose key (or a key below it) `message` names, or None: a --set
    value replaces the recipe's, so an error about that key is the flag's, not the recipe file's."""
    for assignment in reversed(overrides):
        dotted = assignment.split("=", 1)[0].strip()
        shown = re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", dotted)  # errors write inputs.0.path as inputs[0].path
        if dotted and re.search(rf"(?<![\w.]){re.escape(shown)}(?![\w])", message):
            return f"--set {assignment.strip()}"
    return None


def check(condition: bool, message: str) -> None:
    """Validate a user-supplied value (never `assert`: it vanishes under `python -O`)."""
    if not condition:
        raise ConfigError(message)


def help_lines(cls: type, prefix: str = "") -> typing.Iterator[str]:
    """Lines `key: type = default  # note` for the config reference, then `# old was renamed to new` lines."""
    hints = get_type_hints(cls)
    for old, new in getattr(cls, "RENAMED", {}).items():
        yield f"# {prefix}{old} was renamed to {prefix}{new}"
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
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(to_dict(f.default_factory()))
        else:
            default = "(required)"
        value = get_args(tp)[1] if get_origin(tp) is dict and len(get_args(tp)) == 2 else None
        if value is not None and dataclasses.is_dataclass(value):  # a mapping of names to sections (experiment arms)
            yield f"{key}: {_type_name(tp)} = {default}  # {f.metadata.get('help', '')}; each value:"
            yield from help_lines(value, key + ".NAME.")
            continue
        yield f"{key}: {_type_name(tp)} = {default}  # {f.metadata.get('help', '')}"


def _type_name(tp: Any) -> str:
    """A type as a reader writes it, without module paths: `str | None`, `dict[str, ArmConfig]`, `'lm' | 'dpo'`."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is Union or origin is types.UnionType:
        return " | ".join(_type_name(a) for a in args)
    if args:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
