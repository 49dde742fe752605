"""Usage: python -m scripts.bench_preference_packing [--corpus ../shared/data/corpus.jsonl.gz] [--pairs 384] [--per-step 32]

DPO steps on the same preference pairs, preference-packed vs padded pairs, in one run: tokens processed
(row slots, padding included), response tokens, and step time (policy forward+backward plus the frozen
reference forward, CPU, fp32). Pairs come from real passages of the shared corpus: a passage's opening
is the prompt, its true continuation is chosen, another passage's continuation is rejected.
Packed: each step's pairs are best-fit into rows of --seq-len (prompt once, both responses after it).
Padded: each pair is two rows (prompt+chosen, prompt+rejected) padded to the step's longest, the usual
DPO collator. Both use the same model, the same pairs per step and the same loss, so the step's
result is the same (test_packed_logps_equal_unpacked); only the work differs.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import numpy as np
import torch

from datapipe.train.model import GPT, ModelConfig
from datapipe.curation.preferences import passage_pairs
from datapipe.loader.preference_packing import packed_batches
from datapipe.train.dpo import dpo_loss, response_logps

TOKENIZER = str(Path(__file__).resolve().parents[1] / "tokenizers" / "quickstart" / "tokenizer.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="../shared/data/corpus.jsonl.gz")
    ap.add_argument("--pairs", type=int, default=384)
    ap.add_argument("--per-step", type=int, default=32, help="pairs per optimizer step")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=192)
    ap.add_argument("--response-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    texts = []
    with gzip.open(args.corpus, "rt") as f:
        for i, line in enumerate(f):
            if i % 20 == 0:  # every 20th document: all three domains, deterministic
                texts.append(json.loads(line)["text"])
    order = np.random.default_rng(0).permutation(len(texts))
    pairs = passage_pairs([texts[i] for i in order], TOKENIZER, prompt_tokens=args.prompt_tokens,
                          response_tokens=args.response_tokens, limit=args.pairs)
    pairs = [(np.array(p["prompt"]), np.array(p["chosen"]), np.array(p["rejected"])) for p in pairs]
    real = {True: sum(len(p) + len(c) + len(r) for p, c, r in pairs),  # packed: the prompt once
            False: sum(2 * len(p) + len(c) + len(r) for p, c, r in pairs)}  # padded: the prompt in both rows
    print(f"{len(pairs)} pairs, mean prompt {np.mean([len(p) for p, _, _ in pairs]):.0f}, chosen "
          f"{np.mean([len(c) for _, c, _ in pairs]):.0f}, rejected {np.mean([len(r) for _, _, r in pairs]):.0f} tokens")
    cfg = ModelConfig(vocab_size=2048, n_layer=2, n_head=4, d_model=128, max_seq_len=args.seq_len, attention="sdpa")
    policy = GPT(cfg)
    reference = GPT(cfg).eval()
    reference.load_state_dict(policy.state_dict())
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    results = {}
    for name, packed in (("padded", False), ("packed", True)):
        slots = resp_tokens = steps = 0
        times = []
        for k, (batch, n) in enumerate(packed_batches(pairs, range(len(pairs)), args.seq_len,
                                                      10_000 if packed else 2 * args.per_step, packed=packed,
                                                      chunk=args.per_step)):
            t0 = time.perf_counter()
            with torch.no_grad():
                rc, rr = response_logps(reference(batch["input_ids"], position_ids=batch["position_ids"],
                                                  attn_mask=batch["attn_mask"]), batch, n)
            pc, pr = response_logps(policy(batch["input_ids"], position_ids=batch["position_ids"],
                                           attn_mask=batch["attn_mask"]), batch, n)
            loss, _ = dpo_loss(pc, pr, rc, rr, 0.1)
            (loss.sum() / n).backward()
            opt.zero_grad(set_to_none=True)  # no update: both arms see the same weights
            times.append(time.perf_counter() - t0)
            slots += batch["input_ids"].numel()
            resp_tokens += int((batch["resp_id"] >= 0).sum())
            steps += 1
        t = np.array(times[1:])  # the first step warms up
        results[name] = {"steps": steps, "slots": slots, "step_ms": 1000 * float(t.mean()), "step_ms_std": 1000 * float(t.std()),
                         "total_s": float(np.sum(times)), "response_tokens": resp_tokens}
        print(f"{name:7s}: {steps} steps of {args.per_step} pairs | tokens processed {slots:,} "
              f"(real {real[packed]:,}, the prompt {'once' if packed else 'twice'}) | step {results[name]['step_ms']:.0f} "
              f"± {results[name]['step_ms_std']:.0f} ms | total {results[name]['total_s']:.1f} s")
    a, b = results["padded"], results["packed"]
    print(f"packed vs padded: {100 * (1 - b['slots'] / a['slots']):.1f}% fewer tokens processed, "
          f"{100 * (1 - b['step_ms'] / a['step_ms']):.1f}% less step time")


if __name__ == "__main__":
    main()
