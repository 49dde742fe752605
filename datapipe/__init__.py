"""datapipe: raw text → curated, tokenized Arrow shards (on Ray) → packed training batches → a bundled trainer."""

__version__ = "0.1.0"
