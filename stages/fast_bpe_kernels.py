"""The compiled loops of `stages.fast_bpe`'s encoder: the GPT-2 split over a batch's UTF-8 bytes and a table from a
piece's bytes to its ids (`PieceEncoder`), so that a piece seen before costs a hash lookup instead of tiktoken's regex
and merges, and a batch's ids come out as one array instead of a Python list per document.

Nothing here decides an id. The split is `fast_bpe.GPT2_PATTERN` written out as the alternation it is (leftmost
alternative first, greedy runs, `\\s+(?!\\S)` giving back a run's last character when something other than white
space follows); it reads each character's class from a table that `PieceEncoder` fills by asking tiktoken's own regex
engine (`tiktoken_classes`) about each character a batch brings, so the two engines' Unicode tables cannot
differ. A piece the table lacks is encoded by tiktoken's `encode_single_piece`, what its `encode_ordinary` does to each
piece its regex finds; the table only remembers the answer. Tests compare every piece with the pattern's matches and
every id with tiktoken's.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from datapipe.core.compiled import compiled as _compiled

# A character's class under the GPT-2 pattern: all the split needs to know of it
OTHER, LETTER, NUMBER, SPACE = 0, 1, 2, 3
_CLASS_PROBES = ((LETTER, "a"), (NUMBER, "1"), (SPACE, "\t"))


def classes_from_probes(code_points: Sequence[int], one_piece: Any) -> np.ndarray:
    """Each code point's class: a letter when "a"+c is one piece (`one_piece(tests)` answers for a list of test
    strings), else a number when "1"+c is, else white space when "\\t"+c is, else other. Surrogates (never in
    UTF-8 text) are other."""
    classes = np.full(len(code_points), OTHER, np.uint8)
    todo = [k for k, c in enumerate(code_points) if not 0xD800 <= c <= 0xDFFF]
    for kind, lead in _CLASS_PROBES:
        answers = one_piece([lead + chr(code_points[k]) for k in todo])
        classes[[k for k, one in zip(todo, answers) if one]] = kind
        todo = [k for k, one in zip(todo, answers) if not one]
    return classes


def tiktoken_classes(code_points: Sequence[int], pattern: str) -> np.ndarray:
    """Each code point's class under `pattern` as tiktoken's regex engine (fancy-regex) sees it. tiktoken encodes
    each test string with a vocabulary of the 256 bytes and the test strings, so it returns one id exactly when
    the string is one piece."""
    import tiktoken

    def one_piece(tests: list[str]) -> list[bool]:
        ranks = {bytes([b]): b for b in range(256)}
        for t in tests:
            ranks.setdefault(t.encode(), len(ranks))
        encode = tiktoken.Encoding("class-probe", pat_str=pattern, mergeable_ranks=ranks,
                                   special_tokens={})._core_bpe.encode_ordinary
        return [len(encode(t)) == 1 for t in tests]

    return classes_from_probes(code_points, one_piece)


PENDING, UNKNOWN = 254, 255  # a character met, its class being asked; not met yet
MISSING = -1  # a piece the table does not hold (yet)
_APOSTROPHE, _SPACE = 0x27, 0x20


@_compiled(inline="always")
def _character(data: np.ndarray, i: int) -> tuple[int, int]:
    """(the code point of the valid UTF-8 character at data[i], its size in bytes)."""
    b0 = int(data[i])
    if b0 < 0x80:
        return b0, 1
    size = 2 if b0 < 0xE0 else 3 if b0 < 0xF0 else 4
    cp = b0 & (0x7F >> size)
    for k in range(1, size):
        cp = (cp << 6) | (int(data[i + k]) & 0x3F)
    return cp, size


@_compiled()
def unknown_characters(data: np.ndarray, start: int, end: int, classes: np.ndarray) -> np.ndarray:
    """The distinct code points in data[start:end] whose class is `UNKNOWN`, marked `PENDING` in `classes` (the
    caller gives each its class); [-1], with no mark left, when the bytes are not valid UTF-8 (a stray or missing
    continuation byte, an overlong form, a surrogate, a code point past U+10FFFF)."""
    found = [np.int64(0) for _ in range(0)]
    i = start
    while i < end:
        b0 = int(data[i])
        cp = b0
        size = 1 if b0 < 0x80 else 2 if 0xC2 <= b0 < 0xE0 else 3 if 0xE0 <= b0 < 0xF0 else 4 if 0xF0 <= b0 < 0xF5 else 0
        valid = size > 0 and i + size <= end
        for k in range(1, size if valid else 1):
            valid = valid and int(data[i + k]) & 0xC0 == 0x80
        if valid:
            cp, _ = _character(data, i)
            overlong_or_surrogate = size == 3 and (cp < 0x800 or 0xD800 <= cp <= 0xDFFF)
            valid = not overlong_or_surrogate and not (size == 4 and not 0x10000 <= cp <= 0x10FFFF)
        if not valid:
            for cp in found:
                classes[cp] = UNKNOWN
            return np.full(1, -1, np.int64)
        if classes[cp] == UNKNOWN:
            classes[cp] = PENDING
            found.append(cp)
        i += size
    return np.array(found, np.int64) if len(found) else np.empty(0, np.int64)


@_compiled(inline="always")
def _run_end(data: np.ndarray, j: int, end: int, classes: np.ndarray, kind: int) -> int:
    """Where the run of `kind` characters starting at byte j ends."""
    while j < end:
        cp, size = _character(data, j)
        if classes[cp] != kind:
            break
        j += size
    return j


@_compiled(inline="always")
def _contraction(data: np.ndarray, i: int, end: int) -> int:
    """The size of 's|'t|'re|'ve|'m|'ll|'d at data[i] (an apostrophe), 0 if none."""
    if i + 1 < end:
        b = data[i + 1]
        if b == 0x73 or b == 0x74 or b == 0x6D or b == 0x64:  # s t m d
            return 2
        if i + 2 < end:
            b2 = data[i + 2]
            if (b == 0x72 and b2 == 0x65) or (b == 0x76 and b2 == 0x65) or (b == 0x6C and b2 == 0x6C):  # re ve ll
                return 3
    return 0


@_compiled(inline="always")
def _piece_end(data: np.ndarray, i: int, end: int, classes: np.ndarray) -> int:
    """Where the GPT-2 pattern's match starting at byte i ends (every class known)."""
    cp, size = _character(data, i)
    if cp == _APOSTROPHE:
        n = _contraction(data, i, end)
        if n:
            return i + n
    kind = classes[cp]
    j = i + size
    if cp == _SPACE and j < end:  # " ?\p{L}+", " ?\p{N}+", " ?[^\s\p{L}\p{N}]+": the space joins what follows
        cp2, size2 = _character(data, j)
        if classes[cp2] != SPACE:
            return _run_end(data, j + size2, end, classes, classes[cp2])
    if kind != SPACE:
        return _run_end(data, j, end, classes, kind)
    # \s+(?!\S) then \s+: a run of white space gives back its last character when something else follows it
    last = i
    while j < end:
        cp2, size2 = _character(data, j)
        if classes[cp2] != SPACE:
            return last if last > i else j
        last = j
        j += size2
    return j


@_compiled(inline="always")
def _hash(data: np.ndarray, a: int, b: int) -> np.uint64:
    """FNV-1a over data[a:b], then MurmurHash3's finalizer (FNV's low bits alone spread poorly)."""
    h = np.uint64(0xCBF29CE484222325)
    for i in range(a, b):
        h = (h ^ np.uint64(data[i])) * np.uint64(0x100000001B3)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xFF51AFD7ED558CCD)
    return h ^ (h >> np.uint64(33))


@_compiled(inline="always")
def _find(data: np.ndarray, a: int, b: int, h: np.uint64, slots: np.ndarray, hashes: np.ndarray,
          key_start: np.ndarray, key_size: np.ndarray, key_bytes: np.ndarray) -> int:
    """The table entry holding the piece data[a:b] (of hash h), or `MISSING`."""
    mask = len(slots) - 1
    s = np.int64(h & np.uint64(mask))
    while True:
        e = slots[s]
        if e < 0:
            return MISSING
        if hashes[e] == h and key_size[e] == b - a:
            k0 = key_start[e]
            same = True
            for q in range(b - a):
                if key_bytes[k0 + q] != data[a + q]:
                    same = False
                    break
            if same:
                return e
        s = (s + 1) & mask


@_compiled()
def split_and_find(data: np.ndarray, offsets: np.ndarray, classes: np.ndarray, slots: np.ndarray,
                   hashes: np.ndarray, key_start: np.ndarray, key_size: np.ndarray, key_bytes: np.ndarray,
                   count: int, key_bytes_used: int, first_doc: int, piece_entry: np.ndarray,
                   doc_pieces: np.ndarray) -> tuple[int, int, int]:
    """Split the documents data[offsets[d]:offsets[d+1]] from `first_doc` on into the pattern's pieces and give
    each its table entry (piece_entry, numbered on from the pieces of the documents before): a piece the table lacks
    becomes a new entry (count, count + 1, ...; its bytes appended to key_bytes), whose ids the caller adds.
    doc_pieces[d]: the pieces up to and including document d. Returns (the documents done, count,
    key_bytes_used); fewer than all when the next new entry would not fit (`hashes` full, `key_bytes` full, or
    `slots` half full): the caller makes room and calls again from there. Every character's class is known."""
    n = doc_pieces[first_doc - 1] if first_doc > 0 else 0
    mask = len(slots) - 1
    for d in range(first_doc, len(offsets) - 1):
        i, end = offsets[d], offsets[d + 1]
        while i < end:
            j = _piece_end(data, i, end, classes)
            h = _hash(data, i, j)
            e = _find(data, i, j, h, slots, hashes, key_start, key_size, key_bytes)
            if e == MISSING:
                if count == len(hashes) or key_bytes_used + (j - i) > len(key_bytes) or 2 * (count + 1) > len(slots):
                    return d, count, key_bytes_used
                e = count
                key_bytes[key_bytes_used : key_bytes_used + j - i] = data[i:j]
                hashes[e], key_start[e], key_size[e] = h, key_bytes_used, j - i
                key_bytes_used += j - i
                count += 1
                s = np.int64(h & np.uint64(mask))
                while slots[s] >= 0:
                    s = (s + 1) & mask
                slots[s] = e
            piece_entry[n] = e
            n += 1
            i = j
        doc_pieces[d] = n
    return len(offsets) - 1, count, key_bytes_used


@_compiled()
def rehash(hashes: np.ndarray, count: int, slots: np.ndarray) -> None:
    """Place entries 0..count-1 in an empty `slots`."""
    mask = len(slots) - 1
    for e in range(count):
        s = np.int64(hashes[e] & np.uint64(mask))
        while slots[s] >= 0:
            s = (s + 1) & mask
        slots[s] = e


@_compiled()
def gather_ids(piece_entry: np.ndarray, doc_pieces: np.ndarray, id_start: np.ndarray, id_count: np.ndarray,
               ids: np.ndarray, head: int, tail: int, out: np.ndarray, lengths: np.ndarray) -> int:
    """Write each document's ids (`head` first and `tail` last where >= 0) into `out`, its count into `lengths`;
    returns the ids written. Every piece's entry is set."""
    m = 0
    p = 0
    for d in range(len(doc_pieces)):
        m0 = m
        if head >= 0:
            out[m] = head
            m += 1
        while p < doc_pieces[d]:
            e = piece_entry[p]
            a = id_start[e]
            for q in range(id_count[e]):
                out[m] = ids[a + q]
                m += 1
            p += 1
        if tail >= 0:
            out[m] = tail
            m += 1
        lengths[d] = m - m0
    return m


def _grown(array: np.ndarray, size: int) -> np.ndarray:
    """`array` with room for at least `size` items (doubling), its items kept."""
    if len(array) >= size:
        return array
    bigger = np.empty(max(size, 2 * len(array)), array.dtype)
    bigger[: len(array)] = array
    return bigger


def _buffers(text: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(the UTF-8 bytes, each document's start and end in them) of an Arrow string array, without a copy."""
    if not (pa.types.is_string(text.type) or pa.types.is_large_string(text.type)):
        raise TypeError(f"expected an Arrow string array, got {text.type}")
    if text.null_count:  # a null's offsets may span bytes; it is an empty document
        text = pc.fill_null(text, "")
    width = np.int64 if pa.types.is_large_string(text.type) else np.int32
    _, offsets_buffer, data_buffer = text.buffers()
    offsets = np.frombuffer(offsets_buffer, width)[text.offset : text.offset + len(text) + 1].astype(np.int64)
    return (np.frombuffer(data_buffer, np.uint8) if data_buffer is not None else np.empty(0, np.uint8)), offsets


class PieceEncoder:
    """Encodes Arrow text with tiktoken's ids for `encoding` (whose split must be the GPT-2 pattern). One per worker
    process; not thread-safe. The table is emptied when it outgrows its limits, which changes speed, never ids."""

    MAX_ENTRIES = 1 << 19  # with MAX_BYTES, what a worker holds at most (docs/curation.md)
    MAX_BYTES = 32 << 20  # of piece bytes, and of ids
    CHUNK_BYTES = 4 << 20  # of text split at once (the pieces' arrays are 8 bytes a byte of it)

    def __init__(self, encoding: Any) -> None:
        self._encode_piece = encoding._core_bpe.encode_single_piece
        self._pattern = encoding._pat_str
        self.classes = np.full(0x110000, UNKNOWN, np.uint8)
        self._learn(np.arange(128, dtype=np.int64))
        self.clear()

    def clear(self) -> None:
        """Forget every piece."""
        self.count = self.key_bytes_used = self.ids_used = 0
        self.slots = np.full(1 << 16, -1, np.int64)
        self.hashes = np.empty(1 << 15, np.uint64)
        self.key_start = np.empty(1 << 15, np.int64)
        self.key_size = np.empty(1 << 15, np.int64)
        self.id_start = np.empty(1 << 15, np.int64)
        self.id_count = np.empty(1 << 15, np.int64)
        self.key_bytes = np.empty(1 << 18, np.uint8)
        self.ids = np.empty(1 << 17, np.uint32)

    def _learn(self, code_points: np.ndarray) -> None:
        self.classes[code_points] = tiktoken_classes(code_points.tolist(), self._pattern)

    def encode(self, text: pa.Array, head: int = -1, tail: int = -1) -> tuple[np.ndarray, np.ndarray]:
        """(every document's ids, `head` before and `tail` after each where >= 0, as one uint32 array; each
        document's count). `text`: a string or large_string array (a null is an empty document)."""
        data, offsets = _buffers(text)
        parts: list[np.ndarray] = []
        lengths = np.empty(len(text), np.int64)
        first = 0
        while first < len(text):
            fitting = int(np.searchsorted(offsets[first + 1 :], offsets[first] + self.CHUNK_BYTES, "right"))
            last = first + max(fitting, 1)  # a document larger than a chunk is a chunk of its own
            parts.append(self._encode_chunk(data, offsets[first : last + 1], head, tail, lengths[first:last]))
            first = last
        return (parts[0] if len(parts) == 1 else np.concatenate(parts or [np.empty(0, np.uint32)])), lengths

    def split(self, text: pa.Array) -> list[list[bytes]]:
        """Each document's pieces, as the compiled split cuts them (what tiktoken's regex would find)."""
        data, offsets = _buffers(text)
        piece_entry, doc_pieces = self._pieces(data, offsets)
        keys = [self.key_bytes[s : s + n].tobytes() for s, n in zip(self.key_start[piece_entry], self.key_size[piece_entry])]
        bounds = [0, *doc_pieces.tolist()]
        return [keys[a:b] for a, b in zip(bounds, bounds[1:])]

    def _encode_chunk(self, data: np.ndarray, offsets: np.ndarray, head: int, tail: int,
                      lengths: np.ndarray) -> np.ndarray:
        piece_entry, doc_pieces = self._pieces(data, offsets)
        out = np.empty(int(offsets[-1] - offsets[0]) + 2 * len(doc_pieces), np.uint32)
        written = gather_ids(piece_entry, doc_pieces, self.id_start, self.id_count, self.ids, head, tail,
                                     out, lengths)
        return out[:written]

    def _pieces(self, data: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(each piece's entry, with its ids; the pieces up to and including each document) of the documents
        data[offsets[d]:offsets[d+1]]."""
        start, end = int(offsets[0]), int(offsets[-1])
        unknown = unknown_characters(data, start, end, self.classes)
        if len(unknown) and unknown[0] < 0:
            raise ValueError("the text is not valid UTF-8")
        if len(unknown):
            self._learn(unknown)
        if self.count > self.MAX_ENTRIES or max(self.key_bytes_used, 4 * self.ids_used) > self.MAX_BYTES:
            self.clear()
        piece_entry = np.empty(end - start, np.int64)
        doc_pieces = np.empty(len(offsets) - 1, np.int64)
        before = self.count
        try:
            done = 0
            while done < len(doc_pieces):
                done, self.count, self.key_bytes_used = split_and_find(
                    data, offsets, self.classes, self.slots, self.hashes, self.key_start, self.key_size,
                    self.key_bytes, self.count, self.key_bytes_used, done, piece_entry, doc_pieces)
                if done < len(doc_pieces):
                    self._make_room(int(offsets[done + 1] - offsets[done]))
            self._encode_new(before)
        except BaseException:
            self.clear()  # new entries without their ids must not outlive this call
            raise
        return piece_entry[: doc_pieces[-1] if len(doc_pieces) else 0], doc_pieces

    def _make_room(self, piece_bytes: int) -> None:
        """Room for more entries: twice the entries, room for a piece of `piece_bytes` more, slots at most half full."""
        size = 2 * len(self.hashes)
        for name in ("hashes", "key_start", "key_size", "id_start", "id_count"):
            setattr(self, name, _grown(getattr(self, name), size))
        self.key_bytes = _grown(self.key_bytes, self.key_bytes_used + piece_bytes)
        if 2 * (self.count + 1) > len(self.slots):
            self.slots = np.full(2 * len(self.slots), -1, np.int64)
            rehash(self.hashes, self.count, self.slots)

    def _encode_new(self, first: int) -> None:
        """tiktoken's ids for entries first.. (new pieces, distinct)."""
        if first == self.count:
            return
        keys = self.key_bytes[self.key_start[first] : self.key_bytes_used].tobytes()
        base = int(self.key_start[first])
        bounds = (self.key_start[first : self.count] - base).tolist()
        bounds.append(len(keys))
        id_lists = [self._encode_piece(keys[a:b]) for a, b in zip(bounds, bounds[1:])]
        counts = np.fromiter(map(len, id_lists), np.int64, len(id_lists))
        total = int(counts.sum())
        self.ids = _grown(self.ids, self.ids_used + total)
        self.ids[self.ids_used : self.ids_used + total] = np.fromiter(
            itertools.chain.from_iterable(id_lists), np.uint32, total)
        self.id_start[first : self.count] = self.ids_used + np.cumsum(counts) - counts
        self.id_count[first : self.count] = counts
        self.ids_used += total
