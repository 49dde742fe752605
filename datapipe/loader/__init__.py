"""Shards → batches: the streaming PackedLoader and its parts (shard reading, batch planning, loss feedback,
packing, schedules, prioritization, online mixing, preference packing). Torch is needed here; Ray never is."""

from datapipe.loader.packed_loader import PackedLoader

__all__ = ["PackedLoader"]
