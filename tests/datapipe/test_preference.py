"""Tests of preference data: curation of JSONL/Parquet/chat records into preference shards, preference
packing (positions, attention, best-fit rows), packed log-probabilities equal to unpacked ones, the DPO
loss normalisation, and `datapipe train` with objective dpo on a tiny preference set."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from datapipe.core import shards
from datapipe.train.model import GPT, ModelConfig
from datapipe.curation.preferences import PreferenceConfig, curate_preferences, render_prompt
from datapipe.loader.preference_packing import build_rows, load_pairs, pack_items, packed_batches
from datapipe.train.dpo import dpo_loss, response_logps

TOKENIZER = str(Path(__file__).resolve().parents[2] / "tokenizers" / "quickstart" / "tokenizer.json")


def random_pairs(n: int, seed: int = 0, vocab: int = 97) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [tuple(rng.integers(1, vocab, size=int(rng.integers(lo, hi))) for lo, hi in ((2, 20), (1, 15), (1, 15)))
            for _ in range(n)]


def test_packed_rows_positions_and_attention():
    p, c, r = np.array([5, 6, 7]), np.array([8, 9]), np.array([10, 11, 12])
    b = build_rows([[(p, [c, r], [0, 1]), (np.array([3]), [np.array([4])], [2])]], 12)
    assert b["position_ids"][0, :10].tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 0, 1]
    assert b["pred_index"][0, 3:8].tolist() == [2, 3, 2, 5, 6]  # both responses start from the prompt's end
    m = b["attn_mask"][0]
    assert m[6, :3].all() and not m[6, 3:5].any() and m[6, 5:7].all() and not m[6, 7]  # rejected sees prompt+itself
    assert m[4, :5].all() and not m[4, 5:].any()  # chosen sees prompt+itself
    assert not m[8, :8].any() and m[8, 8]  # the next item sees nothing of the first
    assert m.diagonal().all()  # no empty attention row (padding included)


def test_best_fit_packs_several_pairs_per_row_and_loses_none():
    lens = [sum(len(x) for x in t) for t in random_pairs(200, 1)]
    rows, dropped = pack_items(lens, 64)
    assert not dropped and sorted(i for r in rows for i in r) == list(range(200))
    assert all(sum(lens[i] for i in r) <= 64 for r in rows)
    assert len(rows) < 200 / 2  # several pairs per row
    assert sum(lens) / (64 * len(rows)) > 0.9


def test_packed_logps_equal_unpacked():
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=97, n_layer=2, n_head=4, d_model=64, max_seq_len=128, attention="sdpa")).eval()
    pairs = random_pairs(24, 2)
    batches = list(packed_batches(pairs, range(len(pairs)), 64, 4, packed=True, chunk=24))
    got_c, got_r = [], []
    with torch.no_grad():
        for batch, n in batches:
            logits = model(batch["input_ids"], position_ids=batch["position_ids"], attn_mask=batch["attn_mask"])
            c, r = response_logps(logits, batch, n)
            got_c.append(c)
            got_r.append(r)
        # the order of pairs in packed batches: the pack order; rebuild it to compare
        order = []
        lens = [sum(len(x) for x in t) for t in pairs]
        rows, _ = pack_items(lens, 64)
        order = [i for r in rows for i in r]

        def alone(p, resp):  # one plain causal sequence: prompt + response
            seq = torch.from_numpy(np.concatenate([p, resp]))[None]
            lp = torch.log_softmax(model(seq), -1)[0]
            P = len(p)
            return sum(float(lp[P - 1 + k, int(resp[k])]) for k in range(len(resp)))

        want_c = torch.tensor([alone(pairs[i][0], pairs[i][1]) for i in order])
        want_r = torch.tensor([alone(pairs[i][0], pairs[i][2]) for i in order])
    got_c, got_r = torch.cat(got_c), torch.cat(got_r)
    # fp32 on CPU: the same sums, up to reduction order inside attention (measured ~1e-5 nats per response)
    assert torch.allclose(got_c, want_c, atol=1e-4, rtol=0) and torch.allclose(got_r, want_r, atol=1e-4, rtol=0)
    # padded pairs give the same numbers too
    pc = []
    with torch.no_grad():
        for batch, n in packed_batches(pairs, order, 64, 8, packed=False, chunk=24):
            logits = model(batch["input_ids"], position_ids=batch["position_ids"], attn_mask=batch["attn_mask"])
            pc.append(response_logps(logits, batch, n)[0])
    assert torch.allclose(torch.cat(pc), want_c, atol=1e-4, rtol=0)


def test_dpo_loss_and_margin():
    pc, pr = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])
    loss, margin = dpo_loss(pc, pr, torch.zeros(2), torch.zeros(2), beta=0.5)
    assert torch.allclose(margin, torch.tensor([0.5, -1.0]))
    assert torch.allclose(loss, -torch.nn.functional.logsigmoid(margin))


def test_curate_preferences_jsonl_chat_and_parquet(tmp_path):
    recs = [{"prompt": [{"role": "user", "content": "What is 2+2?"}], "chosen": [{"role": "assistant", "content": "4"}],
             "rejected": "5", "id": "a"},
            {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Seven.", "id": "b"}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    pq.write_table(pa.table({"q": ["Hi"], "good": ["Hello"], "bad": ["Go away"]}), tmp_path / "p.parquet")
    assert render_prompt(recs[0]["prompt"]) == "<|user|>\nWhat is 2+2?\n<|assistant|>\n"
    m = curate_preferences(PreferenceConfig(inputs=[str(tmp_path / "p.jsonl")], tokenizer=TOKENIZER, output=str(tmp_path / "o1")))
    assert m["kind"] == "preference" and m["total_docs"] == 2
    pairs = load_pairs(tmp_path / "o1")
    assert all(t[1][-1] == 0 and t[2][-1] == 0 for t in pairs)  # EOS (id 0 in this tokenizer) after each response
    m2 = curate_preferences(PreferenceConfig(inputs=[str(tmp_path / "p.parquet")], prompt_field="q", chosen_field="good",
                                             rejected_field="bad", tokenizer=TOKENIZER, output=str(tmp_path / "o2")))
    assert m2["total_docs"] == 1 and shards.read_manifest(tmp_path / "o2")["shards"][0]["rows"] == 1
    with pytest.raises(ValueError, match="has no field 'prompt'"):
        curate_preferences(PreferenceConfig(inputs=[str(tmp_path / "p.parquet")], tokenizer=TOKENIZER, output=str(tmp_path / "o3")))


def test_dpo_gradient_is_the_mean_over_all_pairs_of_the_step_whatever_the_split():
    from datapipe.train.dpo import backward_step

    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=97, n_layer=1, n_head=2, d_model=32, max_seq_len=64, attention="sdpa")
    policy, reference = GPT(cfg), GPT(cfg).eval()
    pairs = random_pairs(10, 3)

    def grads(splits: list[list[int]]) -> torch.Tensor:
        policy.zero_grad()
        micro = [next(iter(packed_batches(pairs, s, 64, 100, packed=True, chunk=len(s)))) for s in splits]
        backward_step(policy, reference, micro, torch.tensor(10.0), 1, 0.5, torch.device("cpu"))
        return torch.cat([p.grad.flatten() for p in policy.parameters()])

    whole = grads([list(range(10))])
    uneven = grads([[0, 1], list(range(2, 10))])  # 2 pairs and 8 pairs: a per-micro-batch mean would differ
    assert torch.allclose(whole, uneven, atol=1e-6)


def test_train_dpo_end_to_end_on_curated_pairs(tmp_path):
    from datapipe.train.config import load_train_config
    from datapipe.train.loop import train

    rng = np.random.default_rng(0)
    words = "the a data model train loss token shard packed prompt reply good bad".split()
    recs = [{"prompt": " ".join(rng.choice(words, 12)), "chosen": " ".join(rng.choice(words, 6)),
             "rejected": " ".join(rng.choice(words, 5))} for _ in range(40)]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    curate_preferences(PreferenceConfig(inputs=[str(tmp_path / "p.jsonl")], tokenizer=TOKENIZER, output=str(tmp_path / "pref")))
    cfg = load_train_config(Path(__file__).resolve().parents[2] / "configs" / "dpo-tiny.yaml",
                            ["train.steps=3", "train.log_every=1", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
                             "data.seq_len=64", "model.max_seq_len=64", "dpo.eval_pairs=8", "train.device=cpu"],
                            data=str(tmp_path / "pref"), output=str(tmp_path / "run"))
    summary = train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(np.isfinite(r["loss"]) for r in rows)
    assert {"reward_margin", "pref_accuracy", "eval_pref_accuracy"} <= set(rows[-1])
    assert abs(rows[0]["loss"] - np.log(2)) < 1e-3  # policy == reference at step 1: margin 0, loss log 2
    assert summary["pairs"] > 0 and (tmp_path / "run" / "checkpoint.pt").exists()


def test_cli_curate_preferences_and_hf_disk(tmp_path, capsys):
    from datapipe.cli import main

    recs = [{"q": "Say hi.", "a": "hi", "b": "no", "id": str(i)} for i in range(3)]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    (tmp_path / "c.yaml").write_text(f"tokenizer: {TOKENIZER}\nprompt_field: q\nchosen_field: a\nrejected_field: b\n")
    assert main(["curate-preferences", str(tmp_path / "c.yaml"), "--input", str(tmp_path / "p.jsonl"),
                 "--output", str(tmp_path / "o"), "--set", "shard_rows=2"]) == 0
    assert "2 shards, 3 pairs" in capsys.readouterr().out
    assert main(["curate-preferences", str(tmp_path / "c.yaml"), "--set", "nope=1"]) == 2
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(recs).save_to_disk(str(tmp_path / "hf"))
    m = curate_preferences(PreferenceConfig(inputs=[str(tmp_path / "hf")], format="hf_disk", prompt_field="q",
                                            chosen_field="a", rejected_field="b", tokenizer=TOKENIZER,
                                            output=str(tmp_path / "o2")))
    assert m["total_docs"] == 3 and len(load_pairs(tmp_path / "o2")) == 3


@pytest.fixture(scope="module")
def pref_folder(tmp_path_factory) -> Path:
    """20 curated pairs of short word strings (a preference folder)."""
    out = tmp_path_factory.mktemp("pref")
    rng = np.random.default_rng(0)
    words = "the a data model train loss token shard packed prompt reply good bad".split()
    recs = [{"prompt": " ".join(rng.choice(words, 12)), "chosen": " ".join(rng.choice(words, 6)),
             "rejected": " ".join(rng.choice(words, 5))} for _ in range(20)]
    (out / "p.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    curate_preferences(PreferenceConfig(inputs=[str(out / "p.jsonl")], tokenizer=TOKENIZER, output=str(out / "pref")))
    return out / "pref"


def dpo_cfg(source: Path, output: Path, *overrides: str):
    from datapipe.train.config import load_train_config

    return load_train_config(Path(__file__).resolve().parents[2] / "configs" / "dpo-tiny.yaml",
                             ["train.steps=4", "train.log_every=1", "train.eval_every=2", "model.n_layer=1",
                              "model.d_model=32", "model.n_head=2", "data.seq_len=64", "model.max_seq_len=64",
                              "data.batch_size=4", "train.grad_accum=3", "dpo.eval_pairs=8", "train.device=cpu", "train.ckpt_every=0",
                              *overrides], data=str(source), output=str(output))


def test_dpo_resume_is_bitwise_and_the_run_plots(pref_folder, tmp_path):
    """4 steps straight vs 2 + resume + 2: the same losses and parameters on CPU. The 16 training pairs (4 of
    20 held out) make 4 micro-batches an epoch (a pair a row, 4 rows a micro-batch) and a step takes 3, so the
    split falls inside the second epoch and the run crosses epochs on both sides of it."""
    from datapipe.cli import main
    from datapipe.train.loop import train

    straight = train(dpo_cfg(pref_folder, tmp_path / "a"))
    half = train(dpo_cfg(pref_folder, tmp_path / "b", "train.stop_at=2"))
    ckpt = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 2 and ckpt["pair_streams"] == [{"epoch": 1, "index": 2}]
    rest = train(dpo_cfg(pref_folder, tmp_path / "b"), resume=True)
    assert rest["start_step"] == 2 and half["losses"] + rest["losses"] == straight["losses"]  # bitwise
    assert rest["params_sha256"] == straight["params_sha256"] and rest["pairs"] == straight["pairs"]

    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert all("grad_norm" in r and "skipped" in r for r in rows if "loss" in r)  # the shared loop's fields
    assert main(["plot", str(tmp_path / "a")]) == 0  # a DPO run: pairs/s and preference accuracy, no tokens/s
    assert (tmp_path / "a" / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_objective_and_the_data_folder_must_match(pref_folder, tmp_path):
    from helpers import tiny_cfg, write_train_source as write_source
    from datapipe.core.config import ConfigError
    from datapipe.train.loop import train

    text = write_source(tmp_path / "text")
    with pytest.raises(ConfigError, match=r"is a preference folder.*set train.objective: dpo"):
        train(tiny_cfg(pref_folder, tmp_path / "r1", "data.holdout_shards=0"))
    with pytest.raises(ConfigError, match=r"must be a preference folder \(curated with `datapipe curate-preferences`\)"):
        train(dpo_cfg(text, tmp_path / "r2"))


def test_curation_reads_the_eos_from_the_tokenizer_and_keeps_special_text_as_text(tmp_path):
    """An EOS at id 70,000 (not the old default 0, and beyond uint16) and "<|endoftext|>" typed in a prompt."""
    from tokenizers import Tokenizer

    from helpers import with_eos_at

    sparse = tmp_path / "tokenizer.json"
    sparse.write_text(with_eos_at(Path(TOKENIZER).read_text(), 70_000))
    prompt = "Finish the file. <|endoftext|> marks its end."
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": prompt, "chosen": "Done.", "rejected": "No."}))
    m = curate_preferences(PreferenceConfig(inputs=[str(tmp_path / "p.jsonl")], tokenizer=str(sparse), output=str(tmp_path / "o")))
    assert (m["tokenizer"]["eos_id"], m["tokenizer"]["vocab_size"], m["tokenizer"]["dtype"]) == (70_000, 70_001, "uint32")
    (p, c, r), = load_pairs(tmp_path / "o")
    assert c[-1] == 70_000 and r[-1] == 70_000
    assert 70_000 not in p.tolist() and 70_000 not in c[:-1].tolist()  # the typed token stayed text
    assert Tokenizer.from_file(str(sparse)).decode(p.tolist(), skip_special_tokens=False) == prompt


def test_empty_prompts_are_quarantined_at_curation_and_refused_by_packing(tmp_path):
    recs = [{"prompt": "", "chosen": "a", "rejected": "b", "id": "empty"},
            {"prompt": "Say hi.", "chosen": "hi", "rejected": "no", "id": "ok"}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    m = curate_preferences(PreferenceConfig(inputs=[str(tmp_path / "p.jsonl")], tokenizer=TOKENIZER, output=str(tmp_path / "o")))
    assert m["total_docs"] == 1 and m["quarantined"] == {"empty_prompt": 1}
    (q,) = [json.loads(line) for line in (tmp_path / "o" / "quarantine" / "records.jsonl").read_text().splitlines()]
    assert (q["id"], q["record"], q["reason"]) == ("empty", 0, "empty_prompt")
    assert [len(t[0]) > 0 for t in load_pairs(tmp_path / "o")] == [True]
    # packing: a clear error, never log-probs read from another item's response (or column -1)
    empty = (np.array([], dtype=np.int64), np.array([5, 6]), np.array([7]))
    with pytest.raises(ValueError, match="empty prompt"):
        build_rows([[(np.array([1, 2]), [np.array([3]), np.array([4])], [0, 1]), (empty[0], [empty[1], empty[2]], [2, 3])]], 16)
    from datapipe.core.config import ConfigError
    from datapipe.curation.preferences import write_preference_shards

    write_preference_shards(iter([{"id": "e", "domain": "preference", "prompt": [], "chosen": [5, 0], "rejected": [6, 0]}]),
                            tmp_path / "bad", shard_rows=8, vocab_size=100, eos_id=0, tokenizer_path=None, config={})
    with pytest.raises(ConfigError, match="pair 'e' .* has an empty prompt"):
        load_pairs(tmp_path / "bad")
