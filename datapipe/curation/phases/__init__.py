"""The phases of a curation run that are not a module of their own: read, segment, tokenize, shards."""
