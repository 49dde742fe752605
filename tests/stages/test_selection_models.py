"""The selection models: what each score means, checked against answers known without the code under test."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from helpers import ASSETS
from stages.selection import KNOTS, SelectionModel, fit
from stages.selection._importance import CHUNK_WORDS, ImportanceModel, gumbel
from stages.selection._ngrams import count_matrix, word_hashes
from stages.selection._perplexity import CONTEXT_PRIOR, BigramModel


def _slice() -> list[dict]:  # the shipped slice of the shared corpus
    return [json.loads(line) for line in (ASSETS / "corpus_slice.jsonl").read_text().splitlines()]


def test_word_hashes_are_case_blind_and_counts_hold_unigrams_and_bigrams():
    assert (word_hashes("Open the file") == word_hashes("open THE file!")).all()
    m = count_matrix(["a b a", ""], 1 << 20)
    assert m[0].sum() == 3 + 2 and m[1].sum() == 0  # three words, two pairs; an empty document has none


def test_classifier_ranks_held_out_documents_of_the_wanted_kind_first():
    """Documents drawn from two vocabularies that share their common words: a classifier fit on 40 of each ranks 40
    fresh ones of the wanted kind above fresh ones of the other (pairs ordered right >= 0.95)."""
    rng = np.random.default_rng(0)
    common = [f"w{i}" for i in range(50)]
    wanted, other = [f"def{i}" for i in range(200)], [f"prose{i}" for i in range(200)]

    def docs(vocab: list[str], n: int) -> list[str]:
        return [" ".join(rng.choice(common + vocab, size=120)) for _ in range(n)]

    model = fit("classifier", docs(wanted, 40), docs(other, 40), [f"s{i}" for i in range(40)], seed=0)
    good, bad = model.scores(docs(wanted, 40), ["g"] * 40), model.scores(docs(other, 40), ["b"] * 40)
    assert np.mean([g > b for g in good for b in bad]) >= 0.95


def test_gumbel_top_one_picks_in_proportion_to_the_weights():
    """Gumbel-max: P(key of a > key of b) = w_a / (w_a + w_b). Over 4,000 seeds, within 4 standard errors."""
    log_w = np.array([math.log(3.0), 0.0])  # weights 3 and 1: a wins 3/4 of the draws
    wins = sum(bool((log_w + gumbel(["a", "b"], seed)).argmax() == 0) for seed in range(4000))
    assert abs(wins / 4000 - 0.75) < 4 * math.sqrt(0.75 * 0.25 / 4000)


def test_importance_weight_is_the_likelihood_ratio_of_a_chunk_of_the_document_s_ngrams():
    """Smoothed counts: target x, y, (x y) = 1 each over 3 + buckets; raw z = 2, (z z) = 1 over 3 + buckets. 'x y x'
    holds x twice, y, (x y) and (y x), the last unseen in both; its weight is a CHUNK_WORDS-word chunk's at its
    3 words' mean ratio, so a document of the same words repeated weighs the same whatever its length."""
    buckets = 1 << 12
    model = ImportanceModel.fit(["x y"], ["z z"], buckets=buckets)
    ratio_seen = math.log(2 / (3 + buckets)) - math.log(1 / (3 + buckets))  # x, y, (x y): 2 counts in target, 1 in raw
    ratio_unseen = 0.0  # (y x): 1 over 3 + buckets in both
    expected = CHUNK_WORDS / 3 * (4 * ratio_seen + ratio_unseen)
    assert model.log_weights(["x y x"])[0] == pytest.approx(expected)
    assert model.log_weights(["x y " * 200, "x y", ""]).tolist() == pytest.approx(
        [CHUNK_WORDS / 400 * (400 * ratio_seen + 200 * ratio_seen), CHUNK_WORDS / 2 * 3 * ratio_seen, 0.0])


def test_gumbel_top_k_includes_each_document_as_sampling_without_replacement_would():
    """DSIR's scores, kept two of four: the top-2 of log w + Gumbel noise is a draw of two without replacement in
    proportion to w, so document i is kept with probability P(i first) + sum_j P(j first) P(i next | j gone),
    computed exactly here. Over 4,000 seeds each frequency is within 4 standard errors. Without the noise the
    same two are kept every time."""
    words = ["alpha", "beta", "gamma", "delta"]
    weights = np.array([4.0, 2.0, 1.0, 1.0])
    log_ratio = np.zeros(1 << 10)
    for word, w in zip(words, weights):  # one word a document: its weight is CHUNK_WORDS times its unigram's ratio
        log_ratio[count_matrix([word], 1 << 10).indices[0]] = math.log(w) / CHUNK_WORDS
    model = SelectionModel("dsir", 0, ImportanceModel(log_ratio), np.zeros(KNOTS))
    total = weights.sum()
    exact = [weights[i] / total + sum(weights[j] / total * weights[i] / (total - weights[j]) for j in range(4) if j != i)
             for i in range(4)]
    ids = [f"doc-{w}" for w in words]
    seeds = 4000
    kept = np.zeros(4)
    for seed in range(seeds):
        scores = dataclasses.replace(model, seed=seed).scores(words, ids)
        kept[np.argsort(-scores)[:2]] += 1
    for frequency, p in zip(kept / seeds, exact):
        assert abs(frequency - p) < 4 * math.sqrt(p * (1 - p) / seeds)


def test_bigram_perplexity_of_a_seen_pair_by_hand():
    buckets = 1 << 16
    model = BigramModel.fit(["a b", "a c"], [], buckets=buckets)
    p_a = (2 + 1) / (4 + buckets)  # Laplace unigram: a twice among four words
    p_b_uni = (1 + 1) / (4 + buckets)
    lam = 2 / (2 + CONTEXT_PRIOR)  # context a seen twice
    p_b = lam * (1 / 2) + (1 - lam) * p_b_uni  # (a, b) once of a's two
    assert model.log_perplexity(["a b"])[0] == pytest.approx(-(math.log(p_a) + math.log(p_b)) / 2)


def test_perplexity_band_prefers_target_like_text_to_junk_and_to_verbatim_repeats():
    target = [json.loads(line)["text"] for line in (ASSETS / "target_code.jsonl").read_text().splitlines()]
    model = fit("perplexity", target[:10], [], [], seed=0)
    rng = np.random.default_rng(0)
    junk = " ".join("".join(rng.choice(list("qwxzjk"), size=5)) for _ in range(300))
    repeated = "import os\n" * 300
    typical = target[10]
    scores = model.scores([typical, junk, repeated], ["t", "j", "r"])
    assert scores[0] > scores[1] and scores[0] > scores[2]


def test_rank_orders_documents_as_their_scores_and_spreads_over_buckets():
    rng = np.random.default_rng(1)
    scores = np.concatenate([rng.normal(0, 50, 5000), [-1e300, 1e300, 0.0, -0.0, 1e-9]])
    model = SelectionModel("random", 0, None, np.quantile(scores, (np.arange(KNOTS) + 1) / (KNOTS + 1)))
    rank = model.rank(scores)
    order = np.argsort(rank, kind="stable")
    assert (np.diff(scores[order]) <= 0).all()  # ascending rank = descending score
    buckets = np.bincount((rank >> np.uint64(52)).astype(np.int64), minlength=KNOTS + 1)
    assert buckets.max() <= 8  # ~5,000 scores over 4,096 buckets: no bucket holds a crowd


def test_a_model_survives_its_bytes():
    target = [json.loads(line)["text"] for line in (ASSETS / "target_code.jsonl").read_text().splitlines()]
    corpus = [d["text"] for d in _slice()]
    ids = [d["id"] for d in _slice()]
    for method in ("classifier", "dsir", "perplexity", "random"):
        model = fit(method, target, corpus, ids, seed=3)
        again = SelectionModel.from_bytes(model.to_bytes())
        assert again.method == method and again.fit_flops == model.fit_flops
        assert np.allclose(again.scores(corpus, ids), model.scores(corpus, ids))


def test_the_classifier_s_fit_flops_count_its_evaluations_and_its_optimizer(monkeypatch):
    """'a b' and 'a' against 'c': 5 feature nonzeros (a, b, (a b); a; c), 3 documents, 257 parameters at 256 buckets.
    The test counts the loss's evaluations itself; each costs 4 per nonzero, 30 per document, 6 per parameter; each
    L-BFGS iteration 86 per parameter (two-loop product at 10 pairs, step, pair)."""
    from stages.selection import _lbfgs
    from stages.selection._classifier import QualityClassifier

    counted = {}
    minimize = _lbfgs.minimize

    def counting(fun, x0, **kwargs):
        calls = [0]

        def fun_counted(theta):
            calls[0] += 1
            return fun(theta)

        result = minimize(fun_counted, x0, **kwargs)
        counted.update(evaluations=calls[0], iterations=result.iterations)
        return result

    monkeypatch.setattr(_lbfgs, "minimize", counting)
    model = QualityClassifier.fit(["a b", "a"], ["c"], buckets=1 << 8, iterations=7)
    assert count_matrix(["a b", "a", "c"], 1 << 8).nnz == 5  # no two of the n-grams share a bucket
    per_evaluation = 4 * 5 + 30 * 3 + 6 * 257
    expected = 4 * 5 + counted["evaluations"] * per_evaluation + counted["iterations"] * 86 * 257
    assert counted["iterations"] >= 1 and model.fit_flops == expected


def test_lbfgs_reaches_scipy_s_minimum_of_a_logistic_loss_and_of_an_ill_conditioned_quadratic():
    """The BLAS-free L-BFGS against scipy's L-BFGS-B on the same problems: the same minimum to 1e-6 of the loss."""
    import numpy as np
    import scipy.optimize

    from stages.selection import _lbfgs

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(200, 30)), (rng.random(200) < 0.5).astype(np.float64)

    def logistic(theta):
        z = x @ theta
        return float(np.sum(np.logaddexp(0, z) - y * z)) / 200 + 1e-3 * float(theta @ theta), \
            (x.T @ (1 / (1 + np.exp(-z)) - y)) / 200 + 2e-3 * theta

    scale = np.logspace(0, 3, 30)

    def quadratic(theta):
        return 0.5 * float(np.sum(scale * (theta - 1) ** 2)), scale * (theta - 1)

    for fun in (logistic, quadratic):
        ours = _lbfgs.minimize(fun, np.zeros(30), max_iterations=500)
        theirs = scipy.optimize.minimize(fun, np.zeros(30), jac=True, method="L-BFGS-B", options={"maxiter": 500})
        assert ours.value <= theirs.fun + 1e-6 * max(1.0, abs(theirs.fun))
        assert ours.evaluations >= ours.iterations >= 1


def test_fit_flops_add_the_knots_scoring_of_the_corpus_sample():
    """DSIR counts 2 n-grams a word over target and sample (2 + 3 words) and scores the sample's 3 words at 4 a
    word; the classifier adds its fit's own count to the same scoring; random costs nothing."""
    target, corpus, ids = ["a b"], ["c d e"], ["x"]
    assert fit("dsir", target, corpus, ids, seed=0).fit_flops == 2 * 5 + 4 * 3
    classifier = fit("classifier", target, corpus, ids, seed=0)
    assert classifier.fit_flops == classifier.model.fit_flops + 4 * 3 and classifier.model.fit_flops > 0
    assert fit("random", [], corpus, ids, seed=0).fit_flops == 0.0


def test_random_selection_includes_every_document_equally_often():
    """Random's scores, the best three of ten kept by rank: over 3,000 seeds each document is kept 3/10 of the
    time, within 4 standard errors (an id-dependent bias of a few points fails)."""
    ids = [f"doc-{i}" for i in range(10)]
    seeds, kept = 3000, np.zeros(10)
    for seed in range(seeds):
        model = SelectionModel("random", seed, None, np.zeros(KNOTS))
        kept[np.argsort(model.rank(model.scores([""] * 10, ids)), kind="stable")[:3]] += 1
    assert np.abs(kept / seeds - 0.3).max() < 4 * math.sqrt(0.3 * 0.7 / seeds)


def test_fasttext_scores_are_the_binding_s_own_probabilities_of_the_label(tmp_path):
    """A fastText classifier trained here with the binding: datapipe's score of each document is the probability
    the binding's own predict gives `__label__hq` for it as one line."""
    import fasttext

    from stages.selection import FastTextScorer
    from tiny_fasttext import texts, train

    path = train(tmp_path)
    documents = texts("target_code.jsonl")[:5] + [d["text"] for d in _slice()[:20]]
    model = fasttext.load_model(str(path))
    expected = []
    for text in documents:
        labels, probabilities = model.predict(text.replace("\n", " "), k=2)
        expected.append(float(probabilities[list(labels).index("__label__hq")]))
    got = FastTextScorer(str(path), "__label__hq").scores(documents)
    assert got == pytest.approx(expected, abs=1e-6) and max(expected) - min(expected) > 0.1
    saved = fit("fasttext", [], documents, [str(i) for i in range(len(documents))], seed=0,
                scorer=FastTextScorer(str(path), "__label__hq"))
    assert SelectionModel.from_bytes(saved.to_bytes()).scores(documents, ["x"] * len(documents)) == pytest.approx(expected, abs=1e-6)


def test_a_fasttext_file_without_the_label_or_not_a_model_is_refused_by_name(tmp_path):
    from stages.selection import FastTextScorer
    from tiny_fasttext import train

    path = train(tmp_path)
    with pytest.raises(ValueError, match=r"no label '__label__good' \(its labels: __label__"):
        FastTextScorer(str(path), "__label__good").check()
    (tmp_path / "junk.bin").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="fastText cannot load it"):
        FastTextScorer(str(tmp_path / "junk.bin"), "__label__hq").check()
