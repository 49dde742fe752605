"""datapipe: raw text → curated, tokenized Arrow shards (on Ray) → packed training batches → a bundled trainer.

    from datapipe import curate, load_config
    result = curate(load_config("configs/quickstart.yaml"))

`import datapipe` stays light: these names are imported when first used (`__getattr__`).
"""

from typing import Any

__version__ = "0.1.0"

# name -> the module that defines it; `curate` is the `datapipe.curate` package itself, which is callable
_LAZY = {"CurateConfig": "datapipe.curate.config", "load_config": "datapipe.curate.config"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'datapipe' has no attribute {name!r}")
