"""The curation config: one tree of frozen, typed dataclasses, loaded strictly from YAML.

    cfg = load_config("configs/quickstart.yaml", overrides=["dedup.exact.enabled=false"])

Unknown keys and bad values raise `ConfigError` naming the dotted key (and the file). The loader is
the one every command uses (`datapipe.core.config.load`); this module adds the curate flags.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal


from datapipe.core.config import ConfigError, check, load, note, to_dict
from datapipe.core.storage import check_url, is_url
from datapipe.curation.user_stages import build_user_stages
from stages.diversity import DiversityConfig
from stages.exact_dedup import ExactDedupConfig
from stages.langid import LangIdConfig
from stages.minhash import MinHashConfig
from stages.mixture import MixtureConfig
from stages.normalize import NormalizeConfig
from stages.tokenize import TokenizerConfig

InputFormat = Literal["auto", "jsonl", "parquet", "arrow", "text", "hf", "hf_disk"]


@dataclass(frozen=True, kw_only=True)
class InputConfig:
    path: str = note("", help="path, glob or fsspec URL of a file or a folder; or a HF dataset name for 'hf'")
    format: InputFormat = note("auto", help="auto = from the file extension (.jsonl[.gz|.zst|.bz2|.xz], .parquet, .arrow); "
                               "a folder: a saved HF dataset is hf_disk, else the one format of its files' extensions, "
                               "else text (one document per file)")
    domain: str = note("default", help="domain of every document of this input, unless domain_field is set and present")
    domain_field: str | None = note("domain", help="a record field that names its own domain, when present")
    text_field: str = note("text", help="the field holding the document text")
    id_field: str | None = note("id", help="the field holding a document id; absent ids are derived from file + line/row")
    glob: str = note("**/*", help="for format 'text': which files under the folder are documents")
    split: str = note("train", help="for format 'hf': the split to load")
    data_files: list[str] = note([], help="for format 'hf': local data files for a builder such as 'json' or 'parquet'")
    rows_per_unit: int = note(20000, help="for formats 'hf'/'hf_disk'/'text': documents per parallel work unit")

    def __post_init__(self) -> None:
        check(bool(self.path), "path must be a non-empty path, glob or URL")
        check(self.rows_per_unit > 0, f"rows_per_unit must be > 0, got {self.rows_per_unit!r}")


@dataclass(frozen=True, kw_only=True)
class ReadConfig:
    batch_size: int = note(2000, help="documents per record batch flowing through the stages")
    max_bytes_per_doc: int = note(10_000_000, help="longer documents are quarantined (reason 'too_long')")
    block_bytes: int | Literal["auto"] = note(
        "auto", help="text bytes per work block, the unit of parallelism after reading; auto = from the input size "
        "(at least 16 blocks, at most 8 MiB each, but no more than 16,384 blocks: 1 TB gives 61 MB blocks)")

    def __post_init__(self) -> None:
        check(self.batch_size > 0, f"batch_size must be > 0, got {self.batch_size!r}")
        check(self.max_bytes_per_doc > 0, f"max_bytes_per_doc must be > 0, got {self.max_bytes_per_doc!r}")
        check(self.block_bytes == "auto" or self.block_bytes > 0, f"block_bytes must be > 0 or 'auto', got {self.block_bytes!r}")


@dataclass(frozen=True, kw_only=True)
class DedupConfig:
    exact: ExactDedupConfig = note(ExactDedupConfig(), help="exact (hash) deduplication")
    minhash: MinHashConfig = note(MinHashConfig(), help="near-duplicate removal with MinHash-LSH (after the filters)")


@dataclass(frozen=True, kw_only=True)
class OutputConfig:
    dir: str = note("out/", help="output folder (shards, manifest.json, stats.json, dropped/, quarantine/)")
    shard_bytes: int | Literal["auto"] = note(
        "auto", help="target size of one shard file in bytes (token bytes); auto = from the data (at least 4 shards, "
        "at most 64 MiB each: `auto_shard_bytes`)")
    keep_dropped_text: bool = note(False, help="store the text of dropped documents in dropped/")
    keep_work: bool = note(False, help="keep the intermediate work/ folder after a successful run")

    def __post_init__(self) -> None:
        check(self.shard_bytes == "auto" or self.shard_bytes > 0, f"shard_bytes must be > 0 or 'auto', got {self.shard_bytes!r}")
        if is_url(self.dir):  # a URL is written there (datapipe.core.storage), never taken for a local folder
            check_url(self.dir, "dir")


# `auto` work units. Both depend on the data alone, never on the worker count: `output.shard_bytes` decides
# the shards (identical for 1 or 100 CPUs), and `read.block_bytes` decides the work layout, which a resume
# on another machine (other CPUs) must find unchanged. Tiny blocks and shards cost more than their work:
# the quickstart's former 16 KiB blocks and 8 KiB shards made ~60,000 work files and 3,442 shards of the
# 151 MB shared corpus and tripled its CPU time (BENCHMARKS.md).
BLOCK_TARGET_BYTES = 8 * 2**20  # large inputs: blocks of this size (fewer, larger tasks and files)
MIN_BLOCKS = 16  # small inputs: at least this many blocks, so up to 8 workers get 2 each
BLOCK_FLOOR_BYTES = 16 * 2**10  # but no block smaller than this: a tiny input gets fewer blocks
SHARD_TARGET_BYTES = 64 * 2**20  # large outputs: shards of this size
MIN_SHARDS = 4  # small outputs: at least this many shards (a trainer can hold one out, 2 ranks get 2 each)


MAX_BLOCKS = 16_384  # huge inputs: blocks grow past the target rather than outnumber this
# (a shuffle's range reads are blocks x partitions: 1 TB in 8 MiB blocks would be 119,000 senders)


class AutoValue(int):
    """A number that `auto` chose (`auto_block_bytes`, `auto_partitions`), told apart from one the user set so
    that the run record can say which work-layout values `auto` chose (`work_layout`); an int otherwise."""

    __slots__ = ()


def auto_block_bytes(input_bytes: int | None) -> int:
    """The block size for `read.block_bytes: auto`, from an estimate of the input's text bytes (None: unknown).
    Blocks of BLOCK_TARGET_BYTES for large inputs, at least MIN_BLOCKS of them for small ones, never under
    BLOCK_FLOOR_BYTES, and no more than MAX_BLOCKS of them for huge ones (1 TB: 61 MB blocks)."""
    if input_bytes is None:
        return AutoValue(BLOCK_TARGET_BYTES)
    return AutoValue(max(BLOCK_FLOOR_BYTES, min(BLOCK_TARGET_BYTES, -(-input_bytes // MIN_BLOCKS)), -(-input_bytes // MAX_BLOCKS)))


# Memory a partition's task holds per byte of input text, by shuffle (upper estimates: documents of >= 200
# bytes, and the rows, their sort and the pairs in memory at once). Near dedup: 16 bands x 16-byte bucket rows
# a document, ~4x that while sorted and windowed; exact dedup and unique ids: ~50-byte keys a document.
TASK_BYTES_PER_TEXT_BYTE = {"minhash": 5.0, "exact": 1.0}


def auto_partitions(input_bytes: int | None, shuffle: str, budget_bytes: int, floor: int = 16) -> int:
    """Partitions for `partitions: auto`: enough that one partition's task stays under `budget_bytes` for an
    input of `input_bytes` of text (None: unknown, the floor). Depends on the input only, never on the
    workers, so a resume on another cluster finds the same layout."""
    if input_bytes is None:
        return AutoValue(floor)
    return AutoValue(max(floor, -(-int(input_bytes * TASK_BYTES_PER_TEXT_BYTE[shuffle]) // budget_bytes)))


def auto_shard_bytes(token_bytes: int) -> int:
    """The shard size for `output.shard_bytes: auto`, from the token bytes to be written: shards of
    SHARD_TARGET_BYTES for a large output, at least MIN_SHARDS for a small one (documents are never cut,
    so an output of fewer documents gets as many shards as documents)."""
    return max(1, min(SHARD_TARGET_BYTES, -(-token_bytes // MIN_SHARDS)))


@dataclass(frozen=True, kw_only=True)
class EvalSplitConfig:
    enabled: bool = note(
        False,
        help="write a held-out eval split to OUT/eval/, chosen before diversity sampling and the mixture (never "
        "sampled or repeated); copies of its documents are removed from training; the trainer evaluates on it",
    )
    fraction: float = note(0.01, help="share of each domain's documents held out: those whose seeded hash of the id falls below it")
    max_tokens_per_domain: int | None = note(
        None, help="at most this many eval tokens per domain (documents taken lowest hash first, one that would overflow is skipped); null = no cap"
    )
    seed: int = note(0, help="seed of the id hash that chooses the eval documents")
    source: str | None = note(
        None,
        help="another run's eval split (a curated folder such as RUN/eval) held out here instead of choosing one, so "
        "that every arm of an ablation evaluates on the same documents: its shards are copied to OUT/eval/ and every "
        "training copy of its documents (same id, identical tokens, or near with decontaminate: near) is removed. "
        "Needs the same tokenizer; fraction, max_tokens_per_domain and seed are then unused",
    )
    decontaminate: Literal["exact", "near"] = note(
        "near",
        help="drop from training the copies of eval documents: 'exact' (identical tokens) or 'near' (also MinHash-LSH "
        "near-duplicates, with dedup.minhash's settings and threshold, whether or not dedup.minhash is enabled)",
    )

    def __post_init__(self) -> None:
        check(self.enabled or self.source is None, f"source {self.source!r} is set but enabled is false; set eval.enabled: true to use it")
        check(0.0 < self.fraction < 1.0, f"fraction must be in (0, 1), got {self.fraction!r}")
        if self.max_tokens_per_domain is not None:
            check(self.max_tokens_per_domain > 0, f"max_tokens_per_domain must be > 0 or null, got {self.max_tokens_per_domain!r}")


@dataclass(frozen=True, kw_only=True)
class SelectionConfig:
    method: Literal["none", "classifier", "dsir", "perplexity", "fasttext", "random"] = note(
        "none", help="select documents by a model of what you train for (docs/curation.md, 'Selection by a model'): "
        "'classifier' (a linear n-gram classifier of target vs corpus), 'dsir' (importance resampling toward the "
        "target), 'perplexity' (a band of perplexity under a bigram model of the target), 'fasttext' (the probability "
        "an existing fastText classifier, `model`, gives `fasttext_label`), 'random' (a seeded random "
        "subset of the same size: the baseline); 'none' = off")
    target: InputConfig | None = note(None, help="documents of what you train for (an input: path, glob or HF dataset): "
                                      "the classifier's positives, DSIR's target, the perplexity model's text")
    model: str | None = note(None, help="a model file an earlier run saved (its OUT/selection/model.npz), used instead of "
                             "fitting one on `target`; its method must be this method. For 'fasttext': a fastText "
                             "classifier's .bin file (a local file every worker can read)")
    fasttext_label: str = note("__label__hq", help="'fasttext': the label whose probability is the score (DCLM's classifiers: __label__hq)")
    keep_fraction: float | None = note(None, help="keep the best-scored documents holding this fraction of the tokens "
                                       "(of each domain with per_domain, else of the whole corpus)")
    keep_tokens: int | None = note(None, help="keep the best-scored documents until they hold this many tokens, the last one "
                                   "kept crossing it (per domain with per_domain)")
    threshold: float | None = note(None, help="keep the documents scoring at least this (the classifier's logit, DSIR's "
                                   "log weight plus Gumbel noise, the perplexity band's -|log ppl - center|)")
    per_domain: bool = note(False, help="apply keep_fraction / keep_tokens to each domain separately")
    domain_tokens: dict[str, int] = note({}, help="a budget per domain: keep the best-scored documents of each named domain "
                                         "until they hold its tokens, the last one kept crossing it; a domain not named "
                                         "keeps none (e.g. random at another selection's per-domain tokens: a mixture-matched control)")
    target_docs: int = note(20000, help="at most this many target documents fit the model (the first ones read)")
    sample_docs: int = note(20000, help="the corpus side of the model: a seeded sample of about this many training documents")
    seed: int = note(0, help="seed of the corpus sample and of DSIR's and random's Gumbel noise")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def __post_init__(self) -> None:
        if not self.enabled:
            return
        rules = [self.keep_fraction is not None, self.keep_tokens is not None, self.threshold is not None, bool(self.domain_tokens)]
        check(sum(rules) == 1, "set exactly one of keep_fraction, keep_tokens, threshold and domain_tokens")
        check(all(isinstance(n, int) and n >= 0 for n in self.domain_tokens.values()),
              f"domain_tokens must map each domain to a token count >= 0, got {self.domain_tokens!r}")
        check(not (self.domain_tokens and self.per_domain), "domain_tokens is a budget per domain already: leave per_domain off")
        if self.keep_fraction is not None:
            check(0.0 < self.keep_fraction <= 1.0, f"keep_fraction must be in (0, 1], got {self.keep_fraction!r}")
        if self.keep_tokens is not None:
            check(self.keep_tokens > 0, f"keep_tokens must be > 0, got {self.keep_tokens!r}")
        check(self.method != "random" or self.threshold is None, "method 'random' keeps a budget: set keep_fraction, keep_tokens or domain_tokens")
        check(self.method != "fasttext" or (self.model is not None and self.target is None),
              "method 'fasttext' scores with an existing fastText model: set model (its .bin file), not target")
        check(self.method in ("random", "fasttext") or (self.target is None) != (self.model is None),
              f"method {self.method!r} needs exactly one of target (documents to fit on) and model (a saved model file)")
        check(self.target_docs >= 2 and self.sample_docs >= 2, "target_docs and sample_docs must be >= 2")


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    address: str | None = note(None, help="Ray cluster address ('auto', 'ray://host:port', host:port); null = $RAY_ADDRESS when set, else an embedded local Ray")
    num_cpus: int | None = note(None, help="CPUs for the embedded local Ray (null = all)")
    max_retries: int = note(3, help="times a task whose worker died is retried")
    task_memory_gib: float = note(
        4.0, help="the most memory one task should need: `partitions: auto` is chosen so that a partition's task fits "
        "it, and every task tells Ray what it needs (memory=), so that Ray does not pack big tasks onto one node")
    stall_timeout_s: float = note(
        600.0, help="seconds a phase may go without any task finishing before the run stops with an error naming "
        "the phase and the tasks it waits for (workers that never start, a task that hangs); 0 = wait forever")

    def __post_init__(self) -> None:
        check(self.task_memory_gib > 0, f"task_memory_gib must be > 0, got {self.task_memory_gib!r}")
        check(self.stall_timeout_s >= 0, f"stall_timeout_s must be >= 0 (0 = no limit), got {self.stall_timeout_s!r}")


@dataclass(frozen=True, kw_only=True)
class StageConfig:
    path: str = note("", help="your stage or document filter's class as 'module:attr' (e.g. 'my_filters:ShortLines'), "
                     "imported with the working folder on the Python path; its module goes to Ray's workers with the job")
    args: dict[str, Any] = note({}, help="keyword arguments the class is called with")
    version: str | int = note("", help="your code's version, part of the run's identity as path and args are: change it when "
                        "the code changes, so that a run of the old code is not reused or resumed (the code is not hashed)")
    domains: list[str] = note([], help="for a document filter: the domains it checks (empty = every document); a map "
                              "stage sees every document")

    def __post_init__(self) -> None:
        check(bool(self.path), "path must name a class as 'module:attr'")


@dataclass(frozen=True, kw_only=True)
class CurateConfig:
    inputs: list[InputConfig] = note([], help="the raw inputs, in order (their order decides duplicate winners)")
    read: ReadConfig = note(ReadConfig(), help="reading and batching")
    normalize: NormalizeConfig = note(NormalizeConfig(), help="Unicode and whitespace normalization")
    dedup: DedupConfig = note(DedupConfig(), help="deduplication")
    langid: LangIdConfig = note(LangIdConfig(), help="language identification (after exact dedup, before the filters)")
    filters: dict[str, dict[str, dict[str, Any] | None] | None] = note(
        {}, help="quality filters per domain: {'domain', 'domain/lang', '*/lang' or '*': {filter name: {parameters}}}"
    )
    stages: list[StageConfig] = note(
        [], help="your own map stages and document filters, run in order after the filters and before near dedup "
        "(docs/curation.md, 'Your own stages'); a drop is counted under the stage's name")
    tokenizer: TokenizerConfig = note(TokenizerConfig(), help="tokenizer (train or load) and special tokens")
    diversity: DiversityConfig = note(DiversityConfig(), help="diversity sampling per domain (on the tokenized documents)")
    selection: SelectionConfig = note(SelectionConfig(), help="selection by a model (on the tokenized documents, before diversity sampling)")
    mixture: MixtureConfig = note(MixtureConfig(), help="domain mixture reweighting (after diversity sampling)")
    eval: EvalSplitConfig = note(EvalSplitConfig(), help="a held-out eval split (OUT/eval/), chosen before diversity sampling and the mixture")
    output: OutputConfig = note(OutputConfig(), help="where and how shards are written")
    ray: RayConfig = note(RayConfig(), help="where the work runs")

    def __post_init__(self) -> None:
        check(len(self.inputs) > 0, "inputs must list at least one input (in the config, or with --input PATH)")
        from stages.quality import build_filters

        build_filters(self.filters)  # validates filter names and parameters, naming filters.<domain>.<name>
        build_user_stages(self.stages)  # imports and builds them: a bad path or args names stages[i].<key>


# An input given with --input takes every option of the config's first input except these: its path, its
# format (auto: the new path's extension decides) and its domain_field, which is the default 'domain' (a
# record's own `domain` field names its domain, as for any input) unless `--set inputs.0.domain_field=F`.
INPUT_FLAG_OWN = ("path", "format", "domain_field")


def load_config(
    path: str | Path | None,
    overrides: list[str] = (),
    *,
    inputs: list[str] | None = None,
    output: str | None = None,
    ray_address: str | None = None,
) -> CurateConfig:
    """Read a YAML recipe (or start empty), apply `--set` overrides and CLI flags, validate strictly.

    `inputs` (--input) replaces the config's inputs; each takes the options of the config's first input but
    INPUT_FLAG_OWN, and its domain_field too when an override set `inputs.0.domain_field`."""
    overrides = list(overrides)

    def flag_inputs(data: dict) -> list[dict[str, Any]]:
        configured = data.get("inputs") or [{}]
        if not isinstance(configured, list) or not isinstance(configured[0], dict):
            raise ConfigError(f"'inputs' must be a list of inputs, got {configured!r} (a --set inputs.0.KEY=VALUE "
                              "needs inputs in the config)")
        first = configured[0]
        own = [k for k in INPUT_FLAG_OWN if not (k == "domain_field" and _overridden(overrides, "inputs.0.domain_field"))]
        return [{**{k: v for k, v in first.items() if k not in own}, "path": p} for p in inputs]

    flags = {"inputs": flag_inputs if inputs else None, "output.dir": output, "ray.address": ray_address}
    return load(CurateConfig, path, overrides, flags)


def _overridden(overrides: list[str], dotted: str) -> bool:
    return any(o.split("=", 1)[0].strip() == dotted for o in overrides)


# Keys that change where or how fast the work runs, never what it produces.
_EXECUTION_ONLY = {
    ("ray",), ("output", "dir"), ("output", "keep_work"), ("dedup", "exact", "partitions"),
    ("dedup", "minhash", "partitions"), ("dedup", "minhash", "max_rounds"), ("dedup", "minhash", "one_task_edges"),
    ("read", "batch_size"), ("read", "block_bytes"), ("tokenizer", "batch_size"),
    ("tokenizer", "encoder"), ("tokenizer", "verify_bytes"),  # the fast encoder gives the same ids
}


# Execution-only keys that also decide how the unfinished work in OUT/work/ is cut up: the blocks of
# `read.block_bytes` (recorded resolved: `auto` is a number of bytes by then) (their ids and keys are written as each input is read) and the hash partitions the
# global stages shuffle their keys into. Any value gives the same output, but work left under one value
# cannot be finished under another (keys written to 8 partitions are not all found by a resolve over 3),
# so an unfinished run is resumed only with the values it was started with (`layout_conflict`).
WORK_LAYOUT_KEYS = (("read", "block_bytes"), ("dedup", "exact", "partitions"), ("dedup", "minhash", "partitions"))

# The keys a user sets that `auto` reads for each work-layout key, besides the inputs (which a resume cannot
# change): the partitions are sized to fit ray.task_memory_gib (`auto_partitions`), the blocks to the inputs
# alone (`auto_block_bytes`). A resume that changed one of them gets other `auto` values, and its refusal
# names that key, the one the user changed, rather than the layout key the user never set.
AUTO_READS = {
    "read.block_bytes": (),
    "dedup.exact.partitions": ("ray.task_memory_gib",),
    "dedup.minhash.partitions": ("ray.task_memory_gib",),
}


def _value(data: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        data = data[part]
    return data


def work_layout(cfg: CurateConfig) -> dict[str, Any]:
    """For the run record: {dotted key: value} of the WORK_LAYOUT_KEYS of a config whose `auto` values are
    resolved, and under "auto" those that `auto` chose, each with the values of the keys it read (AUTO_READS):
    {"dedup.exact.partitions": {"ray.task_memory_gib": 4.0}}."""
    data = to_dict(cfg)
    keys = [".".join(key) for key in WORK_LAYOUT_KEYS]
    layout: dict[str, Any] = {key: _value(data, key) for key in keys}
    layout["auto"] = {key: {read: _value(data, read) for read in AUTO_READS[key]}
                      for key in keys if isinstance(layout[key], AutoValue)}
    return layout


def layout_conflict(out_dir: str, started: dict[str, Any], now: dict[str, Any]) -> str | None:
    """Why an unfinished run in `out_dir` started with work layout `started` (its run record's `work_layout`)
    cannot be carried on with `now`, or None. The message names the key to set back: the layout key, or, where
    `auto` chose both values, the key it read that the user changed. A record written before "auto" was kept
    names the layout key (as its refusal always did)."""
    for key in (".".join(key) for key in WORK_LAYOUT_KEYS):
        if key not in started or now.get(key) == started[key]:
            continue
        was, auto_now = started.get("auto", {}).get(key), now.get("auto", {}).get(key)
        changed = [read for read in (was or {}) if auto_now is not None and auto_now.get(read) != was[read]]
        if changed:
            read = changed[0]
            return (f"output folder {out_dir} holds an unfinished run started with {read}={was[read]!r} (which set "
                    f"{key}={started[key]!r} by `auto`), not {auto_now[read]!r} (which sets it to {now[key]!r}): its "
                    f"work so far is cut up by {key}. Resume it with `--set {read}={was[read]}` (any value gives the "
                    "same output), or start over in another --output.")
        return (f"output folder {out_dir} holds an unfinished run started with {key}={started[key]!r}, not "
                f"{now.get(key)!r}: its work so far is cut up by that value. Resume it with "
                f"`--set {key}={started[key]}` (any value gives the same output), or start over in another --output.")
    return None


def result_affecting(cfg: CurateConfig) -> dict[str, Any]:
    data = to_dict(cfg)
    if not data["stages"]:  # left out, so that a run without user stages keeps the identity it had before the key
        del data["stages"]
    for key in _EXECUTION_ONLY:
        node = data
        for part in key[:-1]:
            node = node[part]
        node.pop(key[-1], None)
    return data


def config_hash(cfg: CurateConfig) -> str:
    """Hash of everything that decides the output (not where it runs)."""
    blob = json.dumps(result_affecting(cfg), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def diff_configs(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ, with both values, for the refusal message."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for k in sorted(set(old) | set(new), key=str):
            sub = f"{prefix}.{k}" if prefix else str(k)
            out += diff_configs(old.get(k, "<absent>"), new.get(k, "<absent>"), sub)
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):  # items by index, as --set names them
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in diff_configs(a, b, f"{prefix}.{i}")]
    return [] if old == new else [f"{prefix}: {old!r} -> {new!r}"]


__all__ = [
    "CurateConfig", "ConfigError", "InputConfig", "StageConfig", "load_config", "config_hash", "diff_configs", "work_layout",
    "layout_conflict",
    "auto_block_bytes", "auto_shard_bytes",
]
