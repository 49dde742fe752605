"""Fixtures shared by the tests and the benchmarks: synthetic near-duplicates and a fake-shard writer."""
