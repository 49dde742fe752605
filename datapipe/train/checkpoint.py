"""Checkpoints: written atomically with a sha256 beside them, the previous one kept, verified on load.

    save_checkpoint(run_dir / "checkpoint.pt", state)   # checkpoint.pt, checkpoint.prev.pt, checkpoint.sha256
    state = load_checkpoint(run_dir / "checkpoint.pt")  # ConfigError naming the file when it is damaged

`checkpoint.sha256` (sha256sum format, one line per file) holds the digests of checkpoint.pt and
checkpoint.prev.pt. A save writes the new checkpoint to a temporary file, then the digest file
(atomically), then moves checkpoint.pt to checkpoint.prev.pt and the temporary file to checkpoint.pt.
A crash between those steps leaves each file under a name whose digest the digest file lists under
its other name, so a file is intact when its digest is either listed digest: the check holds at
every instant, and a flipped byte or a truncated file never loads. Loads use `weights_only=True`.
A save killed while writing leaves its temporary file (`.checkpoint.pt.tmp-PID-XXXXXXXX`), which
`clear_temporaries` removes when a run starts or resumes in the folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from datapipe.core.config import ConfigError
from datapipe.core.shards import atomic_write_bytes, file_sha256, remove_temporaries, temporary_name


def previous_path(path: Path) -> Path:
    """checkpoint.pt -> checkpoint.prev.pt: the checkpoint before the latest one."""
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def digest_path(path: Path) -> Path:
    """checkpoint.pt -> checkpoint.sha256: the digests of the checkpoint and of the previous one."""
    return path.with_name(f"{path.stem}.sha256")


def _read_digests(path: Path) -> dict[str, str]:
    """{file name: sha256} from the digest file beside `path` (empty when there is none)."""
    file = digest_path(path)
    if not file.exists():
        return {}
    out = {}
    for line in file.read_text().splitlines():
        digest, _, name = line.partition("  ")
        if name:
            out[name] = digest
    return out


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write `state` to `path` (all or nothing), keeping the previous checkpoint as checkpoint.prev.pt."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prev = previous_path(path)
    tmp = temporary_name(path)  # a name `remove_temporaries` knows, should this process be killed mid-write
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before any name points at them
    digests = _read_digests(path)
    lines = [f"{file_sha256(tmp)}  {path.name}"]
    if path.exists():  # about to become the previous checkpoint: list it only if it is intact
        old = file_sha256(path)
        if not digests or old in digests.values():
            lines.append(f"{old}  {prev.name}")
    atomic_write_bytes(digest_path(path), ("\n".join(lines) + "\n").encode(), durable=True)
    if path.exists():
        os.replace(path, prev)
    os.replace(tmp, path)


def clear_temporaries(path: Path) -> list[Path]:
    """Delete the temporary files that killed writers left in the folder of checkpoint `path`: those of the
    shared writers (`remove_temporaries`: a save's `.checkpoint.pt.tmp-PID-XXXXXXXX`, config.yaml's, the
    held-out data's) and the `.checkpoint.pt.tmp-PID` of saves by older versions. Returns them. Call it
    only while nothing writes in that folder (rank 0, before the run writes anything)."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    removed = [Path(p) for p in remove_temporaries(path.parent)]
    older = re.compile(rf"^\.{re.escape(path.name)}\.tmp-\d+$")
    for leftover in path.parent.iterdir():
        if older.match(leftover.name) and leftover.is_file():
            leftover.unlink(missing_ok=True)
            removed.append(leftover)
    return sorted(removed)


def verify_checkpoint(path: Path) -> bool:
    """True when `path` matches a digest of checkpoint.sha256; False when there is no digest file (an older
    datapipe wrote it); a ConfigError naming the file, the fallback and the fix when it matches none."""
    path = Path(path)
    digests = _read_digests(path)
    if not digests:
        return False
    got = file_sha256(path)
    if got in digests.values():
        return True
    prev, fallback = previous_path(path), ""
    if prev.exists():
        fallback = (f"; the previous checkpoint {str(prev)!r} is intact: move it to {str(path)!r} to resume from it"
                    if file_sha256(prev) in digests.values() else f"; the previous checkpoint {str(prev)!r} is damaged too")
    raise ConfigError(f"checkpoint {str(path)!r} is damaged: its sha256 {got[:12]}… ({path.stat().st_size} bytes) "
                      f"matches none in {str(digest_path(path))!r}{fallback}")


def load_checkpoint(path: Path, *, what: str = "--resume") -> dict[str, Any]:
    """The verified checkpoint at `path` as plain tensors/dicts; a ConfigError naming the file otherwise."""
    path = Path(path)
    prev = previous_path(path)
    if not path.exists():
        hint = (f"; {str(prev)!r} holds the checkpoint before it: move it to {str(path)!r} to resume from it"
                if prev.exists() else "; train without --resume first")
        raise ConfigError(f"{what}: no checkpoint at {str(path)!r}{hint}")
    verified = verify_checkpoint(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: name it, never a bare EOFError
        hint = (f"; {str(prev)!r} holds the checkpoint before it: move it to {str(path)!r} to resume from it"
                if prev.exists() and not verified else "")
        raise ConfigError(f"{what}: checkpoint {str(path)!r} cannot be read ({type(exc).__name__}: {exc}){hint}") from None
