"""The fast encoder (tiktoken's core over a compiled tokenizer.json) against `tokenizers`."""

import copy
import json
import re

import orjson
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from helpers import ASSETS
from stages.fast_bpe import (
    GPT2_PATTERN,
    CompiledBPE,
    NotEquivalent,
    byte_level_alphabet,
    compare,
    compile_bpe,
    first_mismatch,
    reference_tokenizer,
    regex_disagreements,
    try_compile,
)
from stages.tokenize import TokenizerConfig, TokenizerTrainConfig, train_tokenizer

DOCS = [orjson.loads(line) for line in (ASSETS / "multilingual_sample.jsonl").read_bytes().splitlines()]
# Every `lang` of ../shared/data/corpus.jsonl.gz (its corpus_stats.json), copied into the asset.
CORPUS_LANGS = {
    "cs", "da", "de", "en", "es", "fi", "fr", "hr", "hu", "id", "it", "ja", "ko", "nl", "pl", "pt", "pt_BR",
    "python", "ro", "ru", "sl", "sr", "sv", "tr", "uk", "zh_CN", "zh_TW",
}
# Hand-written edge cases: contractions, digits, whitespace runs and tabs, CRLF, emoji and ZWJ,
# combining marks, RTL, special-token text, no-break and ideographic spaces.
EXTRA = [
    "I'm sure they'll've said it's 'quoted' — don't 'S 'T.",
    "x = 12345678901234567890 + 3.14e-10\t\t\n\n\n    \r\n  end  ",
    "👩‍👩‍👧 e\u0301 \u0915\u094d\u0937 مرحبا بالعالم שלום  \u00a0\u3000\u2003x",
    "literal <|endoftext|> and <s> and </s> inside a document <|endoftext|>",
    "",
    " ",
    "\n",
    "a" * 3000 + " " + "ab" * 700,
]
TEXTS = [d["text"] for d in DOCS] + EXTRA
IDS = [d["id"] for d in DOCS] + [f"extra-{i}" for i in range(len(EXTRA))]


def test_the_asset_has_every_language_of_the_corpus():
    assert {d["lang"] for d in DOCS} == CORPUS_LANGS
    assert (ASSETS / "multilingual_sample.jsonl").stat().st_size <= 150_000


def _train(vocab_size: int, specials: list[str], min_frequency: int = 2) -> str:
    """Like `train_tokenizer`, but with any list of special tokens (also none)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([d["text"] for d in DOCS], trainer=trainer)
    return tok.to_str()


@pytest.fixture(scope="module")
def tokenizers_():
    return {
        "v300-eos": _train(300, ["<|endoftext|>"], min_frequency=1),
        "v1000-none": _train(1000, []),
        "v2000-eos-bos": _train(2000, ["<|endoftext|>", "<s>", "</s>"]),
        "v2000-datapipe": train_tokenizer(
            [d["text"] for d in DOCS], TokenizerConfig(bos_token="<s>", train=TokenizerTrainConfig(vocab_size=2000))
        ).to_str(),
    }


@pytest.fixture(scope="module")
def tok_json(tokenizers_):
    return tokenizers_["v2000-eos-bos"]


def test_ids_identical_for_several_tokenizers_and_every_language(tokenizers_):
    for name, tok in tokenizers_.items():
        fast = compile_bpe(tok).encoder()
        ref = reference_tokenizer(tok)
        mismatch = first_mismatch(ref, fast, TEXTS, IDS)
        assert mismatch is None, f"{name}: {mismatch.describe()}"
        # and not vacuously: the merges are used
        assert sum(map(len, fast.encode_batch(TEXTS))) < sum(len(t.encode()) for t in TEXTS) * 0.8


def test_special_token_text_inside_a_document_is_plain_text_on_both_paths(tok_json):
    text = "a <|endoftext|> b <s>"
    special = {Tokenizer.from_str(tok_json).token_to_id(t) for t in ("<|endoftext|>", "<s>", "</s>")}
    fast_ids = compile_bpe(tok_json).encoder().encode(text)
    ref_ids = reference_tokenizer(tok_json).encode(text, add_special_tokens=False).ids
    assert fast_ids == ref_ids and not special & set(ref_ids)
    # what `encode_special_tokens` changes: a plain Tokenizer would have matched the special token
    assert special & set(Tokenizer.from_str(tok_json).encode(text, add_special_tokens=False).ids)


def test_byte_level_alphabet_is_tokenizers_table():
    table = byte_level_alphabet()
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet()) and sorted(table.values()) == list(range(256))
    # the mapping itself, through tokenizers' pre-tokenizer, for every byte valid UTF-8 can hold
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    text = "".join(chr(c) for c in [*range(1, 128), 0x80, 0x7FF, 0x800, 0xFFFF, 0x10000, 0x10FFFF])
    text += "".join(chr(0x80 + 64 * k + j) for k in range(30) for j in (0, 63))  # lead bytes C2..DF
    text += "".join(chr(0x1000 * k + 0x80 + j) for k in range(16) for j in range(64) if not 0xD <= k <= 0xD)
    text += "".join(chr(c) for c in (0x10000, 0x40000, 0x80000, 0xC0000, 0x100000))  # lead bytes F0..F4
    (mapped, _), = pre.pre_tokenize_str(text)
    assert bytes(table[c] for c in mapped) == text.encode()


def _spec(tok_json: str) -> dict:
    return json.loads(Tokenizer.from_str(tok_json).to_str())


def _variant(tok_json: str, **changes) -> str:
    spec = copy.deepcopy(_spec(tok_json))
    for key, value in changes.items():
        if key.startswith("model_"):
            spec["model"][key[len("model_") :]] = value
        else:
            spec[key] = value
    return json.dumps(spec)


GPT2_SPLIT = {"type": "Split", "pattern": {"Regex": GPT2_PATTERN}, "behavior": "Isolated", "invert": False}
BYTE_LEVEL_NO_REGEX = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"normalizer": {"type": "NFC"}}, "normalizer"),
        ({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}}, "pre-tokenizer"),
        ({"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}}, "pre-tokenizer"),
        ({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {**GPT2_SPLIT, "pattern": {"Regex": r"\p{L}+|\p{N}{1,3}|\s+|[^\s\p{L}\p{N}]+"}}, BYTE_LEVEL_NO_REGEX]}}, "pre-tokenizer"),
        ({"model_dropout": 0.1}, "dropout"),
        ({"model_ignore_merges": True}, "ignore_merges"),
        ({"model_byte_fallback": True}, "byte_fallback"),
        ({"model_continuing_subword_prefix": "##"}, "continuing_subword_prefix|cannot load"),
        ({"truncation": {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}}, "truncation"),
        ({"post_processor": {"type": "BertProcessing", "sep": ["</s>", 2], "cls": ["<s>", 1]}}, "post-processor"),
    ],
)
def test_pipeline_differences_are_refused_with_a_reason(tok_json, changes, reason):
    compiled, why = try_compile(_variant(tok_json, **changes))
    assert compiled is None and re.search(reason, why)


def test_the_split_then_byte_level_form_and_template_post_processor_are_accepted(tok_json):
    tok = _variant(
        tok_json,
        pre_tokenizer={"type": "Sequence", "pretokenizers": [GPT2_SPLIT, BYTE_LEVEL_NO_REGEX]},
        post_processor={
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
        },
    )
    assert first_mismatch(reference_tokenizer(tok), compile_bpe(tok).encoder(), TEXTS, IDS) is None


def test_vocabulary_problems_are_refused(tok_json):
    spec = _spec(tok_json)
    # a non-special added token: tokenizers would match it inside text
    added = dict(spec, added_tokens=spec["added_tokens"] + [{
        "id": len(spec["model"]["vocab"]), "content": "hello", "single_word": False, "lstrip": False,
        "rstrip": False, "normalized": False, "special": False}])
    assert "not special" in try_compile(json.dumps(added))[1]
    # a vocabulary entry outside the byte-level alphabet
    vocab = dict(spec["model"]["vocab"], **{"hello world": len(spec["model"]["vocab"])})
    assert "byte-level alphabet" in try_compile(json.dumps(dict(spec, model=dict(spec["model"], vocab=vocab))))[1]
    # missing single bytes (trained without the byte-level initial alphabet)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["hello world"] * 5, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    assert "single bytes are not tokens" in try_compile(tok.to_str())[1]
    # not a BPE at all
    wl = Tokenizer(models.WordLevel(vocab={"a": 0, "[UNK]": 1}, unk_token="[UNK]")).to_str()
    assert "model type" in try_compile(wl)[1]
    with pytest.raises(NotEquivalent, match="cannot load"):
        compile_bpe("{not json")


def _handmade(merges: list[tuple[str, str]], ids: list[int] | None = None) -> str:
    """A byte-level BPE tokenizer.json with the 256 bytes (ids 0..255) and the given merges."""
    vocab = {c: b for c, b in byte_level_alphabet().items()}
    for k, (a, b) in enumerate(merges):
        vocab[a + b] = ids[k] if ids else 256 + k
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None, "decoder": None,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [list(m) for m in merges]},
    })


def _raw_tiktoken(tok: str):
    """tiktoken over the vocabulary without any check: what an unchecked compile would produce."""
    table = byte_level_alphabet()
    ranks = {bytes(table[c] for c in t): i for t, i in json.loads(tok)["model"]["vocab"].items()}
    return CompiledBPE(ranks=ranks, pattern=GPT2_PATTERN, special_tokens={}).encoder()


def test_each_condition_is_needed_tiktoken_really_differs_without_it():
    # The basic case is fine.
    ok = _handmade([("a", "b"), ("ab", "c")])
    assert compile_bpe(ok).encoder().encode("abc abcab") == reference_tokenizer(ok).encode("abc abcab").ids
    # C2: token ids not in merge order. tokenizers merges (b, c) first: [a, bc]; tiktoken merges the
    # lower id "ab" first: [ab, c].
    order = _handmade([("b", "c"), ("a", "b")], ids=[257, 256])
    assert reference_tokenizer(order).encode("abc").tokens == ["a", "bc"]
    assert _raw_tiktoken(order).encode("abc") == [256, ord("c")]
    assert "not merge order" in try_compile(order)[1]
    # C3: "abc" is made by (ab, c), but on "abc" itself (b, c) comes first and (a, bc) is no merge,
    # so tokenizers gives [a, bc]; tiktoken merges the phantom pair (a, bc) into "abc".
    phantom = _handmade([("b", "c"), ("a", "b"), ("ab", "c")])
    assert reference_tokenizer(phantom).encode("abc").tokens == ["a", "bc"]
    assert _raw_tiktoken(phantom).encode("abc") == [258]
    assert "splits the token 'abc' itself" in try_compile(phantom)[1]


def test_compare_names_the_first_differing_document():
    assert compare([[1, 2], [3]], [[1, 2], [3]], ["a", "b"]) is None
    m = compare([[1, 2], [3, 4, 5]], [[1, 2], [3, 9, 5]], ["a", "b"])
    assert (m.index, m.doc_id, m.position) == (1, "b", 1) and "'b'" in m.describe()
    assert compare([[1, 2]], [[1, 2, 3]]).position == 2  # one is a prefix of the other


def test_regex_engines_agree_on_character_classes():
    # Latin to CJK punctuation in full (all white space but a few), then a stride over every plane.
    # The benchmark script runs all 1,112,064 code points.
    points = list(range(0x3100)) + list(range(0x3100, 0x110000, 101))
    assert regex_disagreements(points) == {"letter": [], "number": [], "space": []}
