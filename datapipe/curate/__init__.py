"""Raw text → tokenized shards: the runner and its phases, readers, the executors (the only place Ray is imported),
near-dup resolution, selection (diversity, mixture), the embedded corpus and preference curation."""
