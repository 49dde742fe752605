"""datapipe: raw text → curated, tokenized Arrow shards (on Ray) → packed training batches → a bundled trainer.

    from datapipe import curate, load_config
    result = curate(load_config("configs/quickstart.yaml"))   # a CurateResult

`import datapipe` stays light: the names below are imported when first used (`__getattr__`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers and editors see; at run time `__getattr__` imports each on first use
    from datapipe.core.config import ConfigError, RunStopped
    from datapipe.core.workfiles import DamagedWorkFile
    from datapipe.curation.config import CurateConfig, load_config
    from datapipe.curation.identity import RunConflict
    from datapipe.curation.plan import CurateResult
    from datapipe.curation.readers.common import InputError
    from datapipe.curation.report import NothingSurvived
    from datapipe.curation.run import curate
    from datapipe.curation.user_stages import UserStageFailed

# name -> the module that defines it
_LAZY = {
    "curate": "datapipe.curation.run",
    "CurateConfig": "datapipe.curation.config",
    "load_config": "datapipe.curation.config",
    "CurateResult": "datapipe.curation.plan",
    "ConfigError": "datapipe.core.config",  # a config or input that cannot be used (the CLI exits 2)
    "InputError": "datapipe.curation.readers.common",  # an input that cannot be read
    "RunConflict": "datapipe.curation.identity",  # an output folder that holds another run
    "RunStopped": "datapipe.core.config",  # a run stopped for a reason the user must act on (the CLI exits 1)
    "DamagedWorkFile": "datapipe.core.workfiles",  # a work file cut, emptied, changed or gone
    "NothingSurvived": "datapipe.curation.report",  # every document was dropped
    "UserStageFailed": "datapipe.curation.user_stages",  # a user's own stage raised or broke its contract
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'datapipe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
