"""The held-out eval split: chosen before selection and the mixture, with no copy of an eval document
left in training (exact or near), deterministic and resume-identical, shown by `datapipe stats`, and
evaluated on by default by the trainer."""

from __future__ import annotations

import json

import math
import random
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datapipe.core.workfiles import read_record, read_work_table, write_work_table
from tokenizers import Tokenizer

from helpers import ASSETS, run_tasks_in_process, small_config
from datapipe.core.shards import open_shard, read_manifest, split_source
from datapipe.curation.phases import eval_split, near_dedup
from datapipe.curation import steps as run_module  # the run's steps: the tasks each phase launches
from datapipe.curation.executors import LocalExecutor
from datapipe import curate
from datapipe.inspect import stats
from datapipe.testing.synthetic import exact_jaccard, mutate
from datapipe.curation.phases.near_dedup import Groups, KeySource
from stages.minhash import MinHashConfig, bucket_pairs, decide_pairs

FRACTION = 0.3
SHINGLES = MinHashConfig()  # word 5-grams, lowercased: what near dedup and the near check compare
THRESHOLD = 0.8


def _planted_ids() -> tuple[str, str, str]:
    """Ids for an original that the split holds out and two copies that it does not (by the split's hash)."""
    cut = int(FRACTION * 2**64)
    held = lambda i: int(eval_split.eval_rank([i], 0)[0]) < cut  # noqa: E731
    k = 0
    while not held(f"planted-original-{k}") or held(f"planted-copy-{k}") or held(f"planted-near-{k}"):
        k += 1
    return f"planted-original-{k}", f"planted-copy-{k}", f"planted-near-{k}"


def _corpus(tmp_path: Path) -> tuple[list[dict], dict[str, str]]:
    """Real documents of three domains, led by a planted original with an exact and a near copy later on."""
    rows = []
    for name in ("corpus_slice.jsonl", "quality_sample.jsonl"):
        rows += [orjson.loads(line) for line in (ASSETS / name).read_bytes().splitlines()]
    docs = [{"id": r["id"], "text": r["text"], "domain": r["source"]} for r in rows]
    original = next(r for r in rows if r["id"] == "license/adduser")  # the longest document: 1,154 words
    near_text = mutate(original["text"], 0.004, random.Random(0), "substitute")  # exact Jaccard 0.93
    original_id, copy_id, near_id = _planted_ids()
    docs = ([{"id": original_id, "text": original["text"], "domain": "license"}] + docs
            + [{"id": copy_id, "text": original["text"], "domain": "license"},
               {"id": near_id, "text": near_text, "domain": "license"}])
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in docs))
    return [{"path": str(path)}], {"original": original_id, "copy": copy_id, "near": near_id, "near_text": near_text,
                                  "text": original["text"]}


ARMS = {
    "dedup on": {"dedup": {"exact": {"enabled": True, "partitions": 3},
                           "minhash": {"enabled": True, "threshold": THRESHOLD, "partitions": 3}}},
    "raw (dedup off)": {"dedup": {"exact": {"enabled": False}, "minhash": {"enabled": False, "partitions": 3}}},
}
MIXTURE = {"enabled": True, "method": "temperature", "temperature": 3.0, "max_epochs": 3}  # repeats the small domains


def _run(out: Path, inputs: list[dict], eval_cfg: dict | None = None, **sections):
    cfg = small_config(out, inputs, **{"filters": {}, "mixture": MIXTURE, **sections,
                                       "eval": {"enabled": True, "fraction": FRACTION, **(eval_cfg or {})}})
    return curate(cfg, executor=LocalExecutor(), progress=False, log=lambda _: None)


def _rows(folder: Path) -> list[dict]:
    return [r for s in read_manifest(folder)["shards"] for r in open_shard(folder, s["path"]).to_pylist()]


def _dropped(out: Path) -> dict[str, dict]:
    files = sorted((out / "dropped").glob("*.parquet"))
    return {r["id"]: r for r in pa.concat_tables([pq.read_table(f) for f in files]).to_pylist()} if files else {}


def _texts(rows: list[dict], tokenizer: Tokenizer) -> dict[tuple[int, ...], str]:
    """Each distinct token sequence with its text (byte-level BPE decodes losslessly), the EOS cut off."""
    return {tuple(r["tokens"]): tokenizer.decode(r["tokens"][:-1], skip_special_tokens=False) for r in rows}


def _assert_no_eval_document_in_training(out: Path, tokenizer: Path | None = None) -> tuple[list[dict], list[dict]]:
    train, held = _rows(out), _rows(out / "eval")
    assert held, "the eval split is empty: the test would check nothing"
    assert not {r["id"] for r in train} & {r["id"] for r in held}
    tokenizer = Tokenizer.from_file(str(tokenizer or out / "tokenizer.json"))
    train_texts, eval_texts = _texts(train, tokenizer), _texts(held, tokenizer)
    assert not set(train_texts) & set(eval_texts)  # no eval document's tokens are a training document
    for e in eval_texts.values():  # nor near one: brute-force exact Jaccard of the shingles near dedup uses
        worst = max(exact_jaccard(e, t, SHINGLES) for t in train_texts.values())
        assert worst < THRESHOLD
    return train, held


@pytest.mark.parametrize("arm", list(ARMS))
def test_no_eval_document_is_a_training_document_even_under_a_repeating_mixture(tmp_path, arm):
    inputs, planted = _corpus(tmp_path)
    assert 0.85 <= exact_jaccard(planted["text"], planted["near_text"], SHINGLES) < 1.0  # a real near-copy
    out = tmp_path / "out"
    result = _run(out, inputs, **ARMS[arm])
    train, held = _assert_no_eval_document_in_training(out)
    manifest = read_manifest(out)
    assert len(train) > len({r["id"] for r in train})  # the mixture repeated training documents
    assert planted["original"] in {r["id"] for r in held}
    train_ids = {r["id"] for r in train}
    assert planted["copy"] not in train_ids and planted["near"] not in train_ids
    dropped = _dropped(out)
    if arm == "raw (dedup off)":  # nothing else removes them: the split's own decontamination does
        assert dropped[planted["copy"]]["reason"] == "eval_duplicate"
        assert dropped[planted["near"]]["reason"] == "eval_near_duplicate"
        assert dropped[planted["copy"]]["kept_id"] == dropped[planted["near"]]["kept_id"] == planted["original"]
        assert result.stats["eval"]["removed_from_train"]["eval_duplicate"] >= 2  # bzip2 / bzip2-doc too, if held out
    else:  # dedup removed them first: the eval document is the winner of its clusters
        assert dropped[planted["copy"]]["reason"] == "exact_duplicate"
        assert dropped[planted["near"]]["reason"] == "near_duplicate"
    assert all(row["balanced"] for row in result.stats["inputs"])  # eval documents are kept, their copies dropped
    # the manifest's split entry and the eval folder's own manifest agree with the eval shards
    split = manifest["splits"]["eval"]
    assert split["path"] == "eval" and split["total_docs"] == len(held) == read_manifest(out / "eval")["total_docs"]
    assert read_manifest(out / "eval")["split"] == {"name": "eval", "of": ".."}


def test_exact_decontamination_alone_keeps_near_copies(tmp_path):
    """`eval.decontaminate: exact` with dedup off: the identical copy goes, the near copy stays (documented)."""
    inputs, planted = _corpus(tmp_path)
    out = tmp_path / "out"
    _run(out, inputs, {"decontaminate": "exact"}, mixture={"enabled": False}, **ARMS["raw (dedup off)"])
    train_ids = {r["id"] for r in _rows(out)}
    assert planted["copy"] not in train_ids and planted["near"] in train_ids


def test_eval_documents_are_never_sampled_or_repeated(tmp_path):
    inputs, _ = _corpus(tmp_path)
    out = tmp_path / "out"
    result = _run(out, inputs, diversity={"enabled": True, "domains": {"code": 0.5, "license": 0.5, "man": 0.5}},
                  **ARMS["dedup on"])
    held = _rows(out / "eval")
    ids = [r["id"] for r in held]
    assert len(ids) == len(set(ids))  # each once: the mixture never repeats the split
    assert not set(ids) & set(_dropped(out))  # diversity sampling never dropped one
    # diversity sampling saw exactly the documents that survived dedup, less the eval split
    survived = {d: c["docs_out"] for d, c in result.stats["funnel"][-1]["domains"].items()}
    held_per_domain = {d: c["docs"] for d, c in result.stats["eval"]["domains"].items()}
    for d, c in result.stats["diversity"].items():
        assert c["docs_in"] == survived[d] - held_per_domain.get(d, 0)
    assert sum(held_per_domain.values()) == len(held) > 0


def test_token_budget_per_domain(tmp_path):
    inputs, _ = _corpus(tmp_path)
    out = tmp_path / "out"
    result = _run(out, inputs, {"max_tokens_per_domain": 3000, "fraction": 0.9}, **ARMS["dedup on"])
    counted: dict[str, int] = {}
    for r in _rows(out / "eval"):
        counted[r["domain"]] = counted.get(r["domain"], 0) + r["num_tokens"]
    assert counted and all(0 < n <= 3000 for n in counted.values())
    assert {d: c["tokens"] for d, c in result.stats["eval"]["domains"].items()} == counted


def test_a_huge_document_early_in_hash_order_does_not_end_the_budget():
    ids = [f"doc-{i}" for i in range(400)]
    by_rank = [ids[i] for i in np.argsort(eval_split.eval_rank(ids, 0))]
    tokens = {i: 10 for i in ids}
    tokens[by_rank[1]] = 10**6  # the second document in hash order would take the whole budget
    chosen = eval_split.chosen_mask(eval_split.eval_rank(ids, 0), np.array(["d"] * len(ids), dtype=object),
                                    np.array([tokens[i] for i in ids]), np.arange(len(ids)),
                                    eval_split.EvalSplitConfig(fraction=0.5, max_tokens_per_domain=100))
    held = [i for i, c in zip(ids, chosen) if c]
    assert sorted(held) == sorted(by_rank[:1] + by_rank[2:11])  # the ten lowest hashes that fit: 100 tokens


def _keys_of_one_bucket(tmp_path, signatures, orders, num_perm):
    """One map block `seg/x` whose documents (orders `orders`) all share bucket 7, with these signatures."""
    from datapipe.core.shuffle import write_shuffle
    from stages.minhash import stored_signatures

    n = len(orders)
    keys = tmp_path / "keys"
    write_shuffle(keys / "buckets" / "x.shuffle", pa.table({"bucket": pa.array([7] * n, pa.uint64()), "order": pa.array(orders, pa.int64())}),
                  np.zeros(n, np.int64), 1)
    nodes = pa.table({"order": pa.array(orders, pa.int64()), "id": [f"d{o}" for o in orders], "length": pa.array([1] * n, pa.int64()),
                      "signature": stored_signatures(np.asarray(signatures, np.uint32).reshape(n, num_perm))})
    write_shuffle(keys / "nodes" / "x.shuffle", nodes, np.zeros(n, np.int64), 1)
    return KeySource(str(keys), str(tmp_path), ("seg/x",), groups=Groups(1, 1))


def _near_copies(work: Path, eval_orders: list[int], config: MinHashConfig, source: KeySource) -> pa.Table:
    """`eval_split.near_copies` with these documents held out for eval (ids d<order>): its near.arrow."""
    held = pa.table({"order": pa.array(eval_orders, pa.int64()), "id": [f"d{o}" for o in eval_orders],
                     "hash": pa.array([o.to_bytes(16, "little") for o in eval_orders], pa.binary(16))})
    write_work_table(work / eval_split.HELD, held)
    copies = eval_split.near_copies(run_tasks_in_process(), work, config, source)
    found = read_work_table(work / eval_split.NEAR)
    assert found.num_rows == copies
    return found


def test_the_near_check_compares_every_bucket_member_with_the_eval_documents(tmp_path):
    """A bucket {A, H, B} in input order, A held out for eval, B a near copy of A, H unlike both. Near
    dedup verifies each member against the `bucket_window` (here 1) members before it: A-H and H-B,
    never A-B. The eval check meets B with A all the same."""
    config = MinHashConfig(num_perm=8, threshold=0.75, bands=1, rows=8, partitions=1, bucket_window=1, exact_margin=0.0)
    a = np.arange(100, 108, dtype=np.uint32)
    h = np.arange(8, dtype=np.uint32)
    b = a.copy()
    b[0] = 999  # 7 of 8 values equal: estimated Jaccard 0.875
    sig = np.stack([a, h, b])
    buckets = pa.table({"bucket": pa.array([7, 7, 7], pa.uint64()), "order": pa.array([1, 2, 3], pa.int64())})
    u, v = bucket_pairs(buckets, config.bucket_window)
    assert sorted(zip(u.tolist(), v.tolist())) == [(1, 2), (2, 3)]  # near dedup: A-H and H-B, never A-B
    assert len(decide_pairs(u, v, sig[u - 1].astype(np.uint16), sig[v - 1].astype(np.uint16), config).edge_u) == 0
    source = _keys_of_one_bucket(tmp_path, sig, [1, 2, 3], 8)
    found = _near_copies(tmp_path, [1], config, source)
    assert found.to_pylist() == [{"order": 3, "eval_order": 1, "eval_id": "d1"}]


def test_the_near_check_is_bounded_by_the_window_in_a_crowded_bucket(tmp_path):
    """A bucket of 40 eval documents and 10 training documents: each training document meets the first
    `bucket_window` (4) eval documents of the bucket, 40 candidate pairs, not 400."""
    config = MinHashConfig(num_perm=8, threshold=0.75, bands=1, rows=8, partitions=1, bucket_window=4, exact_margin=0.0)
    orders = list(range(50))
    sig = np.tile(np.arange(8, dtype=np.uint32), (50, 1))  # all alike
    source = _keys_of_one_bucket(tmp_path, sig, orders, 8)
    found = _near_copies(tmp_path, list(range(10, 50)), config, source)
    record = read_record(tmp_path / "eval" / "records" / "match-0.json")
    assert record["candidates"] == 40
    # each training document once, named by the first eval document (in input order) it is near
    assert found.column("order").to_pylist() == list(range(10))
    assert set(found.column("eval_order").to_pylist()) == {10}


def _checksums(out: Path) -> list[str]:
    return [s["sha256"] for s in read_manifest(out)["shards"]] + [s["sha256"] for s in read_manifest(out / "eval")["shards"]]


class _Killed(Exception):
    pass


def _dies_after(fn, n: int):
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > n:
            raise _Killed(fn.__name__)
        return fn(*args, **kwargs)

    return wrapped


def test_the_split_is_deterministic_and_a_killed_run_resumes_to_the_same_split(tmp_path, monkeypatch):
    inputs, _ = _corpus(tmp_path)
    raw = ARMS["raw (dedup off)"]  # the arm that runs every eval task (its own MinHash buckets too)
    chooses, choose = [], eval_split.choose  # the choose step's partition count, per task
    monkeypatch.setattr(eval_split, "choose", lambda task, p, rows: (chooses.append(task.partitions), choose(task, p, rows))[1])
    ref = tmp_path / "ref"
    _run(ref, inputs, **raw)
    ref_chooses, chooses[:] = list(chooses), []
    # other blocks, several resolve groups instead of one, more choose tasks: other task boundaries, the same split
    groups, match = [], eval_split.match_task
    monkeypatch.setattr(near_dedup, "GROUP_DOCS", 5)
    monkeypatch.setattr(eval_split, "match_task", lambda shared, g: (groups.append(g), match(shared, g))[1])
    other = tmp_path / "other"
    _run(other, inputs, read={"block_bytes": 2048}, **raw)
    assert _checksums(other) == _checksums(ref)
    assert len(groups) > 1 and min(chooses) > max(ref_chooses)
    monkeypatch.setattr(eval_split, "match_task", match)
    monkeypatch.setattr(eval_split, "choose", choose)
    assert len({r["domain"] for r in _rows(ref / "eval")}) > 1  # domains chosen apart in the reference run
    out = tmp_path / "out"
    for module, task, done in ((eval_split, "hash_task", 1), (eval_split, "candidate_rows", 1), (eval_split, "choose", 0),
                               (eval_split, "bucket_task", 1), (eval_split, "match_task", 1),
                               (run_module, "eval_shard_task", 1)):  # killed in each eval phase in turn, resumed each time
        with monkeypatch.context() as patch:
            patch.setattr(module, task, _dies_after(getattr(module, task), done))
            with pytest.raises(_Killed):
                _run(out, inputs, **raw)
        assert not (out / "manifest.json").exists()
    _run(out, inputs, **raw)
    assert _checksums(out) == _checksums(ref)
    assert read_manifest(out) == read_manifest(ref) and read_manifest(out / "eval") == read_manifest(ref / "eval")


@pytest.fixture(scope="module")
def curated(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("evalsplit")
    inputs, planted = _corpus(tmp)
    out = tmp / "out"
    _run(out, inputs, **ARMS["raw (dedup off)"])
    return out, planted


def test_stats_show_the_split_per_domain(curated, capsys):
    out, planted = curated
    figures = stats.collect(out)
    direct: dict[str, dict[str, int]] = {}
    for r in _rows(out / "eval"):
        d = direct.setdefault(r["domain"], {"docs": 0, "tokens": 0})
        d["docs"] += 1
        d["tokens"] += r["num_tokens"]
    split = figures["splits"]["eval"]
    assert {d: {"docs": c["docs"], "tokens": c["tokens"]} for d, c in split["domains"].items()} == direct
    assert split["manifest_agrees"] is True and split["removed_from_train"]["eval_near_duplicate"] >= 1
    text = stats.render_text(figures)
    assert "Split 'eval' (eval/" in text
    for domain, c in direct.items():
        assert any(line.split()[:3] == [domain, f"{c['docs']:,}", f"{c['tokens']:,}"] for line in text.splitlines())
    assert "<h2>Split &#x27;eval&#x27; (eval/" in stats.render_html(figures, images=[])
    # --why: the held-out original is in an eval shard; its copies name it as the document kept instead
    kept = stats.why(out, planted["original"])
    assert kept["status"] == "kept" and kept["shard"].startswith("eval/shards/")
    copy = stats.why(out, planted["copy"])
    assert copy["stage"] == "eval_split" and copy["kept_id"] == planted["original"] and copy["kept_copy"]["status"] == "kept"


def test_the_trainer_evaluates_on_the_split_by_default(curated, tmp_path):
    from datapipe.train.config import load_train_config
    from datapipe.train.loop import train

    out, _ = curated
    assert split_source(str(out)) == f"{out}/eval"
    cfg = load_train_config(None, ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.max_seq_len=64",
                                   "data.seq_len=64", "data.batch_size=2", "data.eval_batches=1", "train.steps=2",
                                   "train.log_every=1", "train.eval_every=0", "train.ckpt_every=0", "prefetch.enabled=false",
                                   "train.device=cpu"], data=str(out), output=str(tmp_path / "run"))
    summary = train(cfg)
    assert math.isfinite(summary["eval_loss"])
    assert set(summary["eval_domains"]) == set(read_manifest(out / "eval")["domains"])


def test_an_empty_split_is_warned_about_and_not_evaluated_on(tmp_path):
    inputs, _ = _corpus(tmp_path)
    said: list[str] = []
    cfg = small_config(tmp_path / "out", inputs, filters={}, eval={"enabled": True, "fraction": 1e-12})
    curate(cfg, executor=LocalExecutor(), progress=False, log=said.append)
    assert any("the eval split is empty" in line and "eval.fraction" in line for line in said)
    assert read_manifest(tmp_path / "out")["splits"]["eval"]["total_docs"] == 0
    assert split_source(str(tmp_path / "out")) is None


# ---------------------------------------------------------------- eval.source: one split for every arm of an ablation


def test_another_runs_split_is_held_out_unchanged_and_decontaminated(tmp_path):
    """Arm B (another filter, dedup off) takes arm A's split: the same eval documents, none of them (by id, by
    tokens, or near) in B's training data."""
    inputs, planted = _corpus(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    _run(a, inputs, mixture={"enabled": False}, **ARMS["raw (dedup off)"])
    held_a = _rows(a / "eval")
    assert planted["original"] in {r["id"] for r in held_a}
    result = _run(b, inputs, {"source": str(a / "eval")}, mixture={"enabled": False}, filters={"code": {"code": {}}},
                  tokenizer={"path": str(a / "tokenizer.json")}, **ARMS["raw (dedup off)"])
    held_b = _rows(b / "eval")
    assert [(r["id"], r["tokens"]) for r in held_b] == [(r["id"], r["tokens"]) for r in held_a]
    _assert_no_eval_document_in_training(b, a / "tokenizer.json")
    dropped = _dropped(b)
    assert dropped[planted["original"]]["reason"] == "eval_duplicate"  # the eval document itself, by its id
    assert dropped[planted["copy"]]["reason"] == "eval_duplicate"
    assert dropped[planted["near"]]["reason"] == "eval_near_duplicate"
    assert dropped[planted["near"]]["kept_id"] == planted["original"]
    assert result.stats["eval"]["source"] == str(a / "eval")
    assert read_manifest(b)["splits"]["eval"]["total_docs"] == len(held_a)
    from datapipe.inspect.report import format_funnel  # the copied-in split is not taken for mixture copies
    assert "mixture copies" not in format_funnel(result.stats, read_manifest(b))
    assert all(row["balanced"] for row in result.stats["inputs"])


def test_a_bad_eval_source_is_a_config_error_before_any_work(tmp_path):
    from datapipe.core.config import ConfigError

    inputs, _ = _corpus(tmp_path)
    with pytest.raises(ConfigError, match="eval.source"):
        _run(tmp_path / "x", inputs, {"source": str(tmp_path / "missing")})
    assert not (tmp_path / "x" / "work").exists()
    with pytest.raises(ConfigError, match="enabled"):
        small_config(tmp_path / "y", inputs, eval={"enabled": False, "source": str(tmp_path)})
    a = tmp_path / "a"
    _run(a, inputs, mixture={"enabled": False}, **ARMS["raw (dedup off)"])
    with pytest.raises(ConfigError, match="another tokenizer"):  # another vocabulary: other token ids
        _run(tmp_path / "z", inputs, {"source": str(a / "eval")}, mixture={"enabled": False},
             tokenizer={"train": {"vocab_size": 300, "sample_bytes": 200_000}}, **ARMS["raw (dedup off)"])
