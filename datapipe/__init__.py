"""datapipe: curate raw text on Ray into tokenized Arrow shards, and stream them into training batches.

Kept import-light: `stages/` imports `datapipe.schema` and `datapipe.configbase`, and neither
may pull in Ray or torch.
"""

__version__ = "0.1.0"
