"""Tokenize: train (or load) a byte-level BPE with `tokenizers` and encode documents to token ids.

The tokenizer definition (`tokenizer.json`) is the source of truth. Every document is encoded
without the tokenizer's own post-processor and gets the end-of-document id appended (and a
beginning-of-document id prepended when configured); both are validated against the vocabulary
before any work starts. Ids are stored as uint16 when every id fits, else uint32: the bound is the
largest id + 1 (`id_bound`), not `get_vocab_size()`, which counts tokens and is smaller than that when
ids have gaps (an EOS added at id 100,000 to a 50,000-token vocabulary). The manifest records the
bound as the vocabulary size, so a model sized from it has an embedding row for every id.

Special-token text inside a document (e.g. the string "<|endoftext|>") is plain text: it never
becomes the special id mid-document.

Encoding: `tokenizer.encoder` picks `tokenizers` or the fast encoder of `stages.fast_bpe`
(tiktoken's core over the same tokenizer.json behind a compiled split and a table of pieces seen: several times
faster, BENCHMARKS.md). The fast encoder is used only
when the tokenizer is provably equivalent (conditions C0-C3 in `stages/fast_bpe.py`) and, for each
stage instance (one per worker), when the ids of its first `verify_bytes` of input equal
`tokenizers`' ids. Either way the output is `tokenizers`' ids, bit for bit.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from datapipe.core.config import ConfigError, check, note
from stages.fast_bpe import CompiledBPE, FastEncoder, Mismatch, compare, reference_tokenizer, try_compile

log = logging.getLogger(__name__)

Encoder = Literal["auto", "tokenizers", "fast"]
ENCODERS = ("auto", "tokenizers", "fast")


@dataclass(frozen=True, kw_only=True)
class TokenizerTrainConfig:
    vocab_size: int = note(32000, help="target vocabulary size, special tokens included")
    sample_bytes: int = note(20_000_000, help="bytes of kept text (a deterministic sample) to train on")
    min_frequency: int = note(2, help="minimum pair frequency for a merge")
    save_dir: str | None = note(None, help="also copy the trained tokenizer.json here, outside the output folder (it is always OUT/tokenizer.json); best named on the command line with --set")

    def __post_init__(self) -> None:
        check(256 < self.vocab_size <= 2**32, f"vocab_size must be in (256, 2**32], got {self.vocab_size!r}")
        check(self.sample_bytes > 0, f"sample_bytes must be > 0, got {self.sample_bytes!r}")


@dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    path: str | None = note(None, help="an existing tokenizer.json; when null, one is trained (see train)")
    train: TokenizerTrainConfig = note(TokenizerTrainConfig(), help="byte-level BPE training, used when path is null")
    eos_token: str = note("<|endoftext|>", help="end-of-document token appended to every document; must be in the vocabulary")
    bos_token: str | None = note(None, help="optional beginning-of-document token prepended to every document")
    batch_size: int = note(512, help="documents per encode_batch call")
    encoder: Encoder = note(
        "auto",
        help="'tokenizers'; 'fast' (tiktoken's core, same ids, several times faster: BENCHMARKS.md; an error "
        "when not provably equivalent); 'auto' = fast when provably equivalent and the sample check passes, else tokenizers",
    )
    verify_bytes: int = note(
        1_000_000, help="text bytes each worker encodes with both encoders at start and compares (0 = no sample check)"
    )

    def __post_init__(self) -> None:
        check(bool(self.eos_token), "eos_token must be a non-empty string")
        check(self.batch_size > 0, f"batch_size must be > 0, got {self.batch_size!r}")
        check(self.encoder in ENCODERS, f"encoder must be one of {list(ENCODERS)}, got {self.encoder!r}")
        check(self.verify_bytes >= 0, f"verify_bytes must be >= 0, got {self.verify_bytes!r}")


def train_tokenizer(texts: Iterable[str], config: TokenizerConfig) -> Tokenizer:
    """A byte-level BPE (GPT-2 pre-tokenization, no normalizer) trained on `texts`."""
    specials = [config.eos_token] + ([config.bos_token] if config.bos_token else [])
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.train.vocab_size,
        min_frequency=config.train.min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def token_dtype(vocab_size: int) -> pa.DataType:
    """uint16 when every id < `vocab_size` fits, else uint32."""
    return pa.uint16() if vocab_size <= 2**16 else pa.uint32()


def id_bound(tokenizer: Tokenizer) -> int:
    """The largest token id + 1 (added tokens included): what the token dtype and a model's embedding
    must hold (`tokenizers` ids are u32, so uint32 always fits)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1


@dataclass(frozen=True)
class TokenizerInfo:
    """What the manifest records about the tokenizer."""

    path: str
    sha256: str
    vocab_size: int  # the largest token id + 1 (`id_bound`): a model needs this many embedding rows
    eos_id: int
    bos_id: int | None
    dtype: str


def special_ids(tokenizer: Tokenizer, config: TokenizerConfig, where: str) -> tuple[int, int | None]:
    """The EOS (and BOS) ids; a token missing from the vocabulary is a config error."""
    eos = tokenizer.token_to_id(config.eos_token)
    if eos is None:
        raise ConfigError(
            f"tokenizer.eos_token {config.eos_token!r} is not in the vocabulary of {where} "
            f"(size {tokenizer.get_vocab_size()}); name a token it has, or train a new tokenizer"
        )
    bos = None
    if config.bos_token is not None:
        bos = tokenizer.token_to_id(config.bos_token)
        if bos is None:
            raise ConfigError(f"tokenizer.bos_token {config.bos_token!r} is not in the vocabulary of {where}")
    return eos, bos


def describe(tokenizer_json: str, path: str, config: TokenizerConfig) -> TokenizerInfo:
    tokenizer = Tokenizer.from_str(tokenizer_json)
    eos, bos = special_ids(tokenizer, config, path)
    vocab = id_bound(tokenizer)  # the largest id + 1: with gaps in the ids, more than the token count
    return TokenizerInfo(
        path=path,
        sha256=hashlib.sha256(tokenizer_json.encode()).hexdigest(),
        vocab_size=vocab,
        eos_id=eos,
        bos_id=bos,
        dtype=str(token_dtype(vocab)),
    )


TOKENS_COLUMNS = ("id", "domain", "tokens", "num_tokens")


def choose_encoder(tokenizer_json: str, config: TokenizerConfig, where: str = "tokenizer.json",
                   compiled: tuple[CompiledBPE | None, str] | None = None) -> tuple[FastEncoder | None, str]:
    """(the fast encoder or None, why). With `encoder: fast`, a tokenizer that is not provably
    equivalent is a config error; the run can call this before any work starts. `compiled`: what
    `try_compile(tokenizer_json)` answered, when the caller has it (the proof is a function of the text alone)."""
    if config.encoder == "tokenizers":
        return None, "tokenizer.encoder is 'tokenizers'"
    compiled, why = compiled if compiled is not None else try_compile(tokenizer_json)
    if compiled is None:
        if config.encoder == "fast":
            raise ConfigError(
                f"tokenizer.encoder is 'fast' but {where} cannot be compiled into a provably identical "
                f"fast encoder: {why}; use 'auto' or 'tokenizers'"
            )
        return None, f"{where} is not provably equivalent for the fast encoder: {why}"
    return compiled.encoder(), "byte-level BPE compiled for tiktoken (provably equivalent)"


class TokenizeStage:
    """Encodes a batch of documents into (id, domain, tokens, num_tokens). Holds a tokenizer, so the
    tokenize phase keeps one instance per worker process (`datapipe.curation.phases.tokenize._tokenize_stage`) rather than rebuilding it per batch.
    `compiled` is `try_compile(tokenizer_json)`'s answer where the caller made it once for every worker.

    With the fast encoder, the first `config.verify_bytes` of text this instance sees are encoded by
    both encoders; a difference logs a warning naming the document and switches this instance to
    `tokenizers` (with `encoder: fast` it raises instead). The checked documents get `tokenizers`'
    ids, so the output is the same either way."""

    name = "tokenize"

    def __init__(self, tokenizer_json: str, config: TokenizerConfig, where: str = "tokenizer.json",
                 compiled: tuple[CompiledBPE | None, str] | None = None) -> None:
        # Special-token text inside documents stays text (like tiktoken's encode_ordinary).
        self.tokenizer = reference_tokenizer(tokenizer_json)
        self.config = config
        self.where = where
        self.eos_id, self.bos_id = special_ids(self.tokenizer, config, where)
        self.dtype = token_dtype(id_bound(self.tokenizer))
        self._np_dtype = np.uint16 if self.dtype == pa.uint16() else np.uint32
        # encode_batch_fast skips offsets we never use (tokenizers >= 0.20)
        self._encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        self.fast, self.why = choose_encoder(tokenizer_json, config, where, compiled)
        self.mismatch: Mismatch | None = None
        self._refused: str | None = None  # set once `encoder: fast` failed its sample check
        self._verify_left = config.verify_bytes if self.fast is not None else 0
        if self.fast is None and config.encoder == "auto":
            log.warning("%s: encoding with tokenizers (slower): %s", where, self.why)
        else:
            log.info("%s: encoding with %s: %s", where, self.encoder, self.why)

    @property
    def encoder(self) -> str:
        """The encoder now in use: 'fast' or 'tokenizers'."""
        return "fast" if self.fast is not None else "tokenizers"

    def _encode_tokenizers(self, texts: list[str]) -> list[list[int]]:
        n = self.config.batch_size
        out: list[list[int]] = []
        for i in range(0, len(texts), n):
            out.extend(e.ids for e in self._encode(texts[i : i + n], add_special_tokens=False))
        return out

    def _verify(self, texts: pa.Array, doc_ids: Sequence[str] | pa.Array | None) -> tuple[int, list[list[int]]]:
        """Encode the leading documents (up to the bytes left to verify) both ways; return how many
        and tokenizers' ids for them. On a difference, fall back to tokenizers."""
        sizes = pc.binary_length(texts).fill_null(0).to_numpy()
        k = min(int(np.searchsorted(np.cumsum(sizes), self._verify_left)) + 1, len(texts))
        self._verify_left -= int(sizes[:k].sum())
        sample = texts.slice(0, k).to_pylist()
        expected = self._encode_tokenizers(sample)
        names = None if doc_ids is None else doc_ids[:k].to_pylist() if isinstance(doc_ids, pa.Array) else list(doc_ids[:k])
        mismatch = compare(expected, self.fast.encode_batch(sample), names)
        if mismatch is not None:
            self.mismatch = mismatch
            message = f"{self.where}: the fast encoder's ids differ from tokenizers' on {mismatch.describe()}"
            self.fast, self._verify_left = None, 0
            if self.config.encoder == "fast":
                # Every later call refuses too: a retried block must not slip through unchecked.
                self._refused = f"{message}; tokenizer.encoder is 'fast', so the run stops (use 'auto' to fall back)"
                raise RuntimeError(self._refused)
            log.warning("%s; falling back to tokenizers for the rest of this worker's run", message)
            self.why = f"sample check failed: {mismatch.describe()}"
        return k, expected

    def _with_specials(self, id_lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        # tokenizers' id lists (and the sample check's) flattened with the specials; the fast encoder writes them itself
        extra = 1 + (self.bos_id is not None)
        lengths = np.fromiter((len(ids) + extra for ids in id_lists), dtype=np.int64, count=len(id_lists))
        head = [self.bos_id] if self.bos_id is not None else []
        tail = [self.eos_id]
        flat = np.fromiter(
            itertools.chain.from_iterable(itertools.chain(head, ids, tail) for ids in id_lists),
            dtype=self._np_dtype,
            count=int(lengths.sum()),
        )
        return flat, lengths

    def encode(self, texts: Sequence[str] | pa.Array,
               doc_ids: Sequence[str] | pa.Array | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Flat token ids (with specials) and per-document lengths. `doc_ids` only name documents
        in the sample check's warning."""
        if self._refused is not None:
            raise RuntimeError(self._refused)
        if not isinstance(texts, pa.Array):
            texts = pa.array(list(texts), pa.large_string())
        parts: list[tuple[np.ndarray, np.ndarray]] = []
        done = 0
        if self.fast is not None and self._verify_left > 0 and len(texts):
            done, expected = self._verify(texts, doc_ids)
            parts.append(self._with_specials(expected))
        rest = texts.slice(done)
        if self.fast is not None:
            bos = -1 if self.bos_id is None else self.bos_id
            flat, lengths = self.fast.encode_array(rest, bos, self.eos_id)
            parts.append((flat.astype(self._np_dtype, copy=False), lengths))
        else:
            parts.append(self._with_specials(self._encode_tokenizers(rest.to_pylist())))
        if len(parts) == 1:
            return parts[0]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        flat, lengths = self.encode(batch.column("text"), batch.column("id"))
        # int32 list offsets: a block holds far fewer than 2**31 tokens (blocks are a few MB of text)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=self.dtype))
        return pa.RecordBatch.from_arrays(
            [batch.column("id"), batch.column("domain"), tokens, pa.array(lengths, pa.int64())],
            names=list(TOKENS_COLUMNS),
        )
