"""Raw text → tokenized shards: the run (its phases and the one run loop), readers, the executors (the only place
Ray is imported), near-dup resolution, the eval split, selection (diversity, mixture), the embedded corpus and
preference curation. The run's entry point is `datapipe.curate` (defined in `datapipe.curation.run`)."""
