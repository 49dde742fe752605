"""The shared kernel: the typed config base, the document schemas and the shard format. Imports nothing else of datapipe's."""
