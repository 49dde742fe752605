"""Preference data: curation of (prompt, chosen, rejected) records into preference shards.

    datapipe curate-preferences configs/preferences.yaml [--input F] [--output DIR] [--set key=value]

Records. Each record holds a prompt, a chosen and a rejected response (field names configurable),
read from JSONL (.gz), Parquet or a Hugging Face dataset (`hf`: `load_dataset`, `hf_disk`:
`load_from_disk`). A field may be a string or a chat-style list of messages {"role", "content"},
rendered with this template (documented, deliberately simple):

    prompt messages   -> "<|{role}|>\\n{content}\\n" for each message, then "<|assistant|>\\n"
    response messages -> the contents of its assistant messages (all messages if none), joined by "\\n"

Text is encoded as the main pipeline encodes documents (`stages.tokenize`): special-token text inside a
record (e.g. "<|endoftext|>" in a prompt) stays text, never a special id. Responses get the id of
`eos_token`, read from the tokenizer, appended. A record whose prompt encodes to no token is quarantined
(reason `empty_prompt`, in OUT/quarantine/records.jsonl, counted in the manifest's `quarantined`):
its responses would be predicted from no prompt position at all. Token ids are stored as uint16 when
the largest id fits, and the manifest's vocabulary size is the largest id + 1. Shards have the curated shard layout and manifest
(`datapipe.core.shards`) with columns `id`, `domain`, `prompt_tokens`, `chosen_tokens`, `rejected_tokens`
and `num_tokens` (prompt + chosen + rejected), and the manifest says `"kind": "preference"`.

Packing lives in datapipe/loader/preference_packing.py, the DPO loss in datapipe/train/dpo.py.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from datapipe.core import shards
from datapipe.core.config import ConfigError, check, note
from datapipe.core.storage import is_url
from stages.fast_bpe import reference_tokenizer
from stages.tokenize import id_bound, token_dtype

PROMPT, CHOSEN, REJECTED = 0, 1, 2

# ------------------------------------------------------------------------------------------- records


def render_prompt(value: str | Sequence[Mapping[str, str]]) -> str:
    """A prompt string, or chat messages rendered with the template of the module docstring."""
    if isinstance(value, str):
        return value
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in value) + "<|assistant|>\n"


def render_response(value: str | Sequence[Mapping[str, str]]) -> str:
    if isinstance(value, str):
        return value
    msgs = [m for m in value if m.get("role") == "assistant"] or list(value)
    return "\n".join(m["content"] for m in msgs)


@dataclass(frozen=True, kw_only=True)
class PreferenceConfig:
    RENAMED: ClassVar[dict[str, str]] = {"eos_id": "eos_token"}  # the EOS is named by its token, its id read from the tokenizer

    inputs: list[str] = note([], help="paths or globs of preference records (or HF dataset names with format hf); --input replaces them")
    format: Literal["auto", "jsonl", "parquet", "hf", "hf_disk"] = note("auto", help="auto: by file extension (.parquet, else JSONL, .gz allowed)")
    split: str = note("train", help="the split of a Hugging Face dataset")
    prompt_field: str = note("prompt", help="field holding the prompt (string or list of messages)")
    chosen_field: str = note("chosen", help="field holding the chosen response (string or list of messages)")
    rejected_field: str = note("rejected", help="field holding the rejected response (string or list of messages)")
    tokenizer: str = note("tokenizers/quickstart/tokenizer.json", help="a `tokenizers` tokenizer.json (the one the text shards were curated with)")
    eos_token: str = note("<|endoftext|>", help="token appended to every response; its id is read from the tokenizer")
    max_prompt_tokens: int = note(256, help="prompts are cut to their last this many tokens")
    max_response_tokens: int = note(256, help="responses are cut to their first this many tokens (EOS included)")
    shard_rows: int = note(4096, help="pairs per shard")
    output: str = note("out/preferences", help="output folder; --output replaces it")
    domain: str = note("preference", help="the domain written into every row")

    def __post_init__(self) -> None:
        check(len(self.inputs) > 0, "inputs must name at least one file, glob or dataset (in the config, or with --input PATH)")
        check(not is_url(self.output), f"output must be a local folder (preference curation writes only there), got the "
                                       f"URL {self.output!r}; write locally and copy the folder to object storage")
        for name in ("max_prompt_tokens", "max_response_tokens", "shard_rows"):
            check(getattr(self, name) >= 1, f"{name} must be an integer >= 1, got {getattr(self, name)!r}")


def read_records(cfg: PreferenceConfig) -> Iterator[dict[str, Any]]:
    for spec in cfg.inputs:
        fmt = cfg.format
        if fmt in ("hf", "hf_disk"):
            import datasets

            ds = datasets.load_from_disk(spec) if fmt == "hf_disk" else datasets.load_dataset(spec, split=cfg.split)
            if fmt == "hf_disk" and isinstance(ds, datasets.DatasetDict):
                ds = ds[cfg.split]
            yield from ds
            continue
        paths = sorted(glob.glob(spec)) or [spec]
        for path in paths:
            kind = fmt if fmt != "auto" else ("parquet" if path.endswith(".parquet") else "jsonl")
            if kind == "parquet":
                yield from pq.read_table(path).to_pylist()
            elif kind == "jsonl":
                with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
                    for number, line in enumerate(f, 1):
                        if line.strip():
                            try:
                                yield json.loads(line)
                            except json.JSONDecodeError as exc:
                                raise ConfigError(f"{path} line {number}: not a JSON record ({exc.msg}); "
                                                  "inputs must be JSONL, Parquet or (format hf/hf_disk) datasets") from None
            else:
                raise ConfigError(f"format must be one of {{'auto', 'jsonl', 'parquet', 'hf', 'hf_disk'}}, got {fmt!r}")


def _table(rows: list[dict[str, Any]], dtype: pa.DataType) -> pa.Table:
    return pa.table({
        "id": pa.array([r["id"] for r in rows], pa.string()),
        "domain": pa.array([r["domain"] for r in rows], pa.string()),
        "prompt_tokens": pa.array([r["prompt"] for r in rows], pa.list_(dtype)),
        "chosen_tokens": pa.array([r["chosen"] for r in rows], pa.list_(dtype)),
        "rejected_tokens": pa.array([r["rejected"] for r in rows], pa.list_(dtype)),
        "num_tokens": pa.array([len(r["prompt"]) + len(r["chosen"]) + len(r["rejected"]) for r in rows], pa.int64()),
    })


def write_preference_shards(triples: Iterator[dict[str, Any]], out: str | Path, *, shard_rows: int, vocab_size: int,
                            eos_id: int, tokenizer_path: str | None, config: dict[str, Any],
                            quarantined: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Write triples {id, domain, prompt, chosen, rejected (token lists)} as preference shards + manifest.
    `vocab_size` is the largest token id + 1. `quarantined` is filled while `triples` is consumed (records
    set aside, each with a `reason`): written to OUT/quarantine/records.jsonl and counted in the manifest."""
    out = Path(out)
    dtype = token_dtype(vocab_size)
    infos, buf = [], []
    for t in triples:
        buf.append(t)
        if len(buf) == shard_rows:
            infos.append(shards.write_shard(out, len(infos), _table(buf, dtype)))
            buf = []
    if buf:
        infos.append(shards.write_shard(out, len(infos), _table(buf, dtype)))
    tok = {"eos_id": eos_id, "bos_id": None, "dtype": str(dtype), "vocab_size": vocab_size,
           "path": tokenizer_path, "sha256": shards.file_sha256(tokenizer_path) if tokenizer_path and Path(tokenizer_path).exists() else None}
    blob = json.dumps(config, sort_keys=True, default=str).encode()
    manifest = {**shards.build_manifest(infos, tokenizer=tok, config=config, config_hash=hashlib.sha256(blob).hexdigest()[:16]),
                "kind": "preference"}
    counts: dict[str, int] = {}
    for q in quarantined or []:
        counts[q["reason"]] = counts.get(q["reason"], 0) + 1
    if quarantined:
        shards.atomic_write_bytes(out / "quarantine" / "records.jsonl", b"".join(json.dumps(q).encode() + b"\n" for q in quarantined))
    else:  # a rerun into the same folder leaves no stale list behind
        (out / "quarantine" / "records.jsonl").unlink(missing_ok=True)
    manifest["quarantined"] = dict(sorted(counts.items()))
    shards.write_manifest(out, manifest)
    return manifest


def curate_preferences(cfg: PreferenceConfig) -> dict[str, Any]:
    """Render, tokenize and write every record of `cfg.inputs`; returns the manifest."""
    _check_paths(cfg)
    tok = reference_tokenizer(Path(cfg.tokenizer).read_text())  # special-token text in a record stays text
    eos_id = _token_id(tok, cfg.eos_token, cfg.tokenizer)
    vocab_size = id_bound(tok)  # the largest id + 1: decides the dtype, sizes a model's embedding
    quarantined: list[dict[str, Any]] = []

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    def triples() -> Iterator[dict[str, Any]]:
        for i, rec in enumerate(read_records(cfg)):
            for name in (cfg.prompt_field, cfg.chosen_field, cfg.rejected_field):
                if name not in rec:
                    raise ConfigError(f"record {i} has no field {name!r}; its fields are {sorted(rec)!r} "
                                      "(set prompt_field/chosen_field/rejected_field)")
            prompt = encode(render_prompt(rec[cfg.prompt_field]))[-cfg.max_prompt_tokens:]
            if not prompt:
                quarantined.append({"record": i, "id": str(rec.get("id", i)), "reason": "empty_prompt",
                                    "detail": f"field {cfg.prompt_field!r} encodes to no token"})
                continue
            resp = [encode(render_response(rec[f]))[: cfg.max_response_tokens - 1] + [eos_id]
                    for f in (cfg.chosen_field, cfg.rejected_field)]
            yield {"id": str(rec.get("id", i)), "domain": cfg.domain, "prompt": prompt, "chosen": resp[0], "rejected": resp[1]}

    from dataclasses import asdict

    return write_preference_shards(triples(), cfg.output, shard_rows=cfg.shard_rows, vocab_size=vocab_size,
                                   eos_id=eos_id, tokenizer_path=cfg.tokenizer, config=asdict(cfg), quarantined=quarantined)


def _token_id(tokenizer: Any, token: str, where: str) -> int:
    """The id of `token` (the EOS); a token the vocabulary lacks is a config error."""
    found = tokenizer.token_to_id(token)
    if found is None:
        raise ConfigError(f"eos_token {token!r} is not in the vocabulary of {where}; name a token it has")
    return found


def _check_paths(cfg: PreferenceConfig) -> None:
    """The tokenizer and every local input exist, and the output is not another kind of run: before any work."""
    if not Path(cfg.tokenizer).is_file():
        raise ConfigError(f"tokenizer must be a tokenizer.json file, got {cfg.tokenizer!r}: no such file")
    for i, spec in enumerate(cfg.inputs):
        if cfg.format != "hf" and "://" not in spec and not glob.glob(spec):
            raise ConfigError(f"inputs[{i}] {spec!r}: no such file, and no file matches it as a glob")
    if Path(cfg.output, shards.MANIFEST_NAME).is_file():
        try:
            kind = shards.read_manifest(cfg.output).get("kind")
        except ValueError:  # not JSON, or another format version
            kind = None
        if kind != "preference":  # rewriting a preference folder is a rerun; anything else is someone's data
            raise ConfigError(f"output {cfg.output!r} holds another run (a curated folder that is not preference "
                              "shards); write the preference shards to another folder (--output DIR)")


def passage_pairs(texts: Sequence[str], tokenizer_path: str, *, prompt_tokens: int = 48, response_tokens: int = 32,
                  eos_id: int | None = None, seed: int = 0, limit: int | None = None) -> list[dict[str, Any]]:
    """A realistic preference set from real passages: the passage's first `prompt_tokens` tokens are the
    prompt, its true continuation is chosen, and the continuation of another passage (a mismatch) rejected.
    Lengths vary: each passage's prompt and responses are cut at a random length up to the maxima.
    `eos_id` None: the tokenizer's id of <|endoftext|>."""
    tok = reference_tokenizer(Path(tokenizer_path).read_text())  # special-token text in a passage stays text
    if eos_id is None:
        eos_id = _token_id(tok, "<|endoftext|>", tokenizer_path)
    rng = np.random.default_rng(seed)
    need = prompt_tokens + response_tokens
    docs = [ids for ids in (e.ids for e in tok.encode_batch([t[:20_000] for t in texts], add_special_tokens=False))
            if len(ids) >= need]
    if limit is not None:
        docs = docs[:limit]
    if len(docs) < 2:
        raise ValueError(f"texts must hold at least 2 passages of >= {need} tokens, got {len(docs)}")
    out = []
    shift = rng.permutation(len(docs))
    for i, ids in enumerate(docs):
        p = int(rng.integers(prompt_tokens // 4, prompt_tokens + 1))
        c = int(rng.integers(response_tokens // 4, response_tokens + 1))
        other = docs[shift[i]] if shift[i] != i else docs[(i + 1) % len(docs)]
        r = int(rng.integers(response_tokens // 4, response_tokens + 1))
        out.append({"id": str(i), "domain": "preference", "prompt": ids[:p], "chosen": ids[p : p + c - 1] + [eos_id],
                    "rejected": other[p : p + r - 1] + [eos_id]})
    return out


DEFAULT_TOKENIZER = str(Path(__file__).resolve().parents[2] / "tokenizers" / "quickstart" / "tokenizer.json")


def default_preference_set(out: str | Path, n: int = 2000, log=print, *, tokenizer_path: str = DEFAULT_TOKENIZER,
                           seed: int = 0) -> str:
    """The embedded default corpus (stdlib docstrings and code) as preference shards in `out`; returns it."""
    from datapipe.curation import embedded

    if Path(out, "manifest.json").exists():
        return str(out)
    paths = embedded.prepare(0, log=log)
    texts = []
    for domain in ("prose", "code"):
        with open(paths[domain]) as f:
            texts += [json.loads(line)["text"] for line in f]
    order = np.random.default_rng(seed).permutation(len(texts))
    pairs = passage_pairs([texts[i] for i in order[: n * 2]], tokenizer_path, seed=seed, limit=n)
    tok = reference_tokenizer(Path(tokenizer_path).read_text())
    write_preference_shards(iter(pairs), out, shard_rows=1024, vocab_size=id_bound(tok),
                            eos_id=_token_id(tok, "<|endoftext|>", tokenizer_path),
                            tokenizer_path=tokenizer_path, config={"default_preference_set": {"n": n, "seed": seed}})
    log(f"built a default preference set of {len(pairs)} pairs (stdlib passages) -> {out}")
    return str(out)
