"""Curation stages, one concept per module: a small class with a typed config and a pure function over Arrow
record batches (map stages), or the keys and decide halves of a global stage. Stages import only datapipe.core."""
