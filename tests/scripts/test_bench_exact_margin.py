"""The margin benchmark's truth and decisions: brute force by prefix filtering equals every pair's intersection
counted (`synthetic.true_pairs`), and the clusters' agreement is counted from the clusters themselves."""

import random

import numpy as np
import orjson

from datapipe.testing.synthetic import MUTATIONS, components, mutate, true_pairs
from helpers import ASSETS
from scripts.bench_exact_margin import agreement, all_shingle_sets, brute_force_pairs, cluster_labels
from stages.minhash import MinHashConfig


def _planted() -> list[str]:
    rng = random.Random(5)
    originals = [orjson.loads(line)["text"] for line in (ASSETS / "corpus_slice.jsonl").read_bytes().splitlines()]
    copies = [mutate(t, rng.choice([0.01, 0.05, 0.1, 0.2]), rng, rng.choice(MUTATIONS)) for t in originals[:60]]
    return originals + copies


def test_prefix_filtered_brute_force_finds_every_pair_at_each_threshold():
    texts, config = _planted(), MinHashConfig()
    sets = all_shingle_sets(texts, config)
    for threshold in (0.5, 0.7, 0.8, 0.9):
        i, j = brute_force_pairs(sets, threshold)
        expected = true_pairs(texts, config, threshold)
        assert len(expected) > 10 and set(zip(i.tolist(), j.tolist())) == expected, threshold


def test_clusters_agreement_counts_pairs_and_removals():
    truth = cluster_labels(6, np.array([0, 1, 3]), np.array([1, 2, 4]))  # {0, 1, 2}, {3, 4}, {5}
    assert truth.tolist() == components(6, [(0, 1), (1, 2), (3, 4)])
    found = cluster_labels(6, np.array([0, 3, 4]), np.array([1, 4, 5]))  # {0, 1}, {2}, {3, 4, 5}
    got = agreement(found, truth)
    # pairs together: found {01, 34, 35, 45}, true {01, 02, 12, 34}: 2 shared; removed: found {1, 4, 5}, true {1, 2, 4}
    assert (got["pair_precision"], got["pair_recall"]) == (0.5, 0.5)
    assert (got["removed_precision"], got["removed_recall"], got["removed"]) == (round(2 / 3, 5), round(2 / 3, 5), 3)
