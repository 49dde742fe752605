"""Checkpoints: written atomically (temporary file, then os.replace), loaded with weights_only=True."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from datapipe.core.config import ConfigError


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """torch.save to a temporary file in the same folder, then os.replace: all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"--resume: no checkpoint at {str(path)!r}; train without --resume first")
    return torch.load(path, map_location="cpu", weights_only=True)
