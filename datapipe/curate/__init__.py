"""Raw text → tokenized shards: the run (its phases and the one run loop), readers, the executors (the only place
Ray is imported), near-dup resolution, the eval split, selection (diversity, mixture), the embedded corpus and
preference curation.

The package is also the run's entry point: `from datapipe import curate; curate(cfg, ...)` calls
`datapipe.curate.run.curate`. A package and a function cannot share the name `datapipe.curate` (importing any
module below it binds the name to the package), so the package is made callable instead.
"""

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self, cfg: Any, **kwargs: Any) -> Any:
        """`curate(cfg, *, executor=None, extra_stages=(), progress=True, verbose=False, log=print)`: run the
        curation `cfg` describes (`datapipe.curate.run.curate`)."""
        from datapipe.curate.run import curate

        return curate(cfg, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
