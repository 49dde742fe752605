"""Settings objects of the loader's optional features (prioritization, online mixing): their shared checks and the
values `PackedLoader` accepts for them (None/False, True, a mapping of fields, or the settings object)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np

from datapipe.core.config import ConfigError

T = TypeVar("T")


def check_integers(settings: Any, key: str, lows: tuple[tuple[str, int], ...]) -> None:
    """Each named field is an integer (not a bool) ≥ its low bound; the error names `key.field`."""
    for name, low in lows:
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ConfigError(f"{key}.{name} must be an integer ≥ {low}, got {value!r}")


def from_value(cls: type[T], value: Any, key: str) -> T | None:
    """None/False -> None (off), True -> the defaults, a mapping -> those fields (unknown keys refused), or the object."""
    if value is None or value is False:
        return None
    if value is True:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        allowed = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise ConfigError(f"{key} keys must be among {sorted(allowed)!r}, got {unknown!r}")
        return cls(**value)
    raise ConfigError(f"{key} must be None, a bool, a mapping or a {cls.__name__}, got {value!r}")
