"""The compiled loops of `stages.quality` (numba): a batch's code points, its tokens and lines found once and shared
by every filter, and each filter's checks over them, duplicates found by hashing with every match compared in full.

Each kernel takes a batch as `cps` (every text's code points, one after another; text t is
cps[offsets[t]:offsets[t + 1]]) with a `flags` table of character classes (`CLASSES`, built by `stages.quality` from
Python's own `re` and `str`), checks only the texts where `active` is set, and answers one reason code per text (0:
kept). The codes stand for the checks `stages.quality` names, in the order it runs them: Python's decisions, computed
here in one pass per split instead of regexes and lists of strings (`datapipe.testing.quality_reference` is that
Python, and the tests compare the two). A threshold that is off (null) arrives as NaN, which no comparison passes.
"""

from __future__ import annotations

import numpy as np

from stages.minhash_kernels import _compiled, _fmix64

# character classes (bits of `flags[code point]`)
SPACE = 1  # str.isspace, re's \s
WORD = 2  # re's \w
DIGIT = 4  # re's \d
ALPHA = 8  # re's [^\W\d_]
ALNUM = 16  # str.isalnum
LINE_BREAK = 32  # where str.splitlines cuts
CLASSES = {"SPACE": SPACE, "WORD": WORD, "DIGIT": DIGIT, "ALPHA": ALPHA, "ALNUM": ALNUM, "LINE_BREAK": LINE_BREAK}

_NEWLINE = 10
_CR = 13
_DOT = 46
_HASH = 35
_HYPHEN = 45
_BULLET = 0x2022
_ELLIPSIS = 0x2026
_OPEN_BRACKET = 91
_CLOSE_BRACKET = 93
_CURLY = 123
_DOTTED_CAPITAL_I = 0x130  # the one code point whose lower() is two: "i" and U+0307
_COMBINING_DOT = 0x307
_CAPITAL_SIGMA = 0x3A3  # lower() gives σ or, at a word's end, ς
_HASH_MULT = np.uint64(0x9E3779B97F4A7C15)


@_compiled()
def _grow(a: np.ndarray) -> np.ndarray:
    out = np.empty(2 * len(a) + 16, dtype=a.dtype)
    out[: len(a)] = a
    return out


@_compiled()
def decode_utf8(data: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the code points of every text, their offsets): text t is data[offsets[t]:offsets[t + 1]], valid UTF-8 (Arrow's
    strings are)."""
    texts = len(offsets) - 1
    cps = np.empty(offsets[texts] - offsets[0], dtype=np.uint32)
    cp_offsets = np.empty(texts + 1, dtype=np.int64)
    k = 0
    for t in range(texts):
        cp_offsets[t] = k
        i, end = offsets[t], offsets[t + 1]
        while i < end:
            b0 = np.uint32(data[i])
            if b0 < 0x80:
                cps[k] = b0
                i += 1
            elif b0 < 0xE0:
                cps[k] = ((b0 & 0x1F) << 6) | (data[i + 1] & 0x3F)
                i += 2
            elif b0 < 0xF0:
                cps[k] = ((b0 & 0x0F) << 12) | ((data[i + 1] & 0x3F) << 6) | (data[i + 2] & 0x3F)
                i += 3
            else:
                cps[k] = (((b0 & 0x07) << 18) | ((data[i + 1] & 0x3F) << 12) | ((data[i + 2] & 0x3F) << 6)
                          | (data[i + 3] & 0x3F))
                i += 4
            k += 1
    cp_offsets[texts] = k
    return cps[:k], cp_offsets


@_compiled(inline="always")
def _is_joiner(cp: np.uint32) -> bool:
    return cp == _HYPHEN or cp == 39 or cp == 0x2019 or cp == _DOT  # - ' ’ .


@_compiled()
def split_tokens(cps: np.ndarray, offsets: np.ndarray, flags: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token starts, token ends, each text's first token and the end): `stages.quality.tokenize`'s regex
    `\\w+(?:[-'’.]\\w+)*|[^\\w\\s]+`, i.e. a run of word characters joined by single joiners, or a run of characters
    that are neither word nor space."""
    texts = len(offsets) - 1
    starts = np.empty(len(cps) // 4 + 16, dtype=np.int64)
    ends = np.empty(len(starts), dtype=np.int64)
    tok_offsets = np.empty(texts + 1, dtype=np.int64)
    k = 0
    for t in range(texts):
        tok_offsets[t] = k
        i, end = offsets[t], offsets[t + 1]
        while i < end:
            f = flags[cps[i]]
            if f & SPACE:
                i += 1
                continue
            first = i
            i += 1
            if f & WORD:
                while True:
                    while i < end and flags[cps[i]] & WORD:
                        i += 1
                    if i + 1 < end and _is_joiner(cps[i]) and flags[cps[i + 1]] & WORD:
                        i += 2
                    else:
                        break
            else:
                while i < end and not flags[cps[i]] & (WORD | SPACE):
                    i += 1
            if k == len(starts):
                starts, ends = _grow(starts), _grow(ends)
            starts[k], ends[k] = first, i
            k += 1
    tok_offsets[texts] = k
    return starts[:k], ends[:k], tok_offsets


@_compiled()
def split_lines(cps: np.ndarray, offsets: np.ndarray, flags: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(line starts, line ends, each text's first line and the end): `str.splitlines()` (\\r\\n one break; no line
    after a final break; none in an empty text)."""
    texts = len(offsets) - 1
    starts = np.empty(len(cps) // 32 + 16, dtype=np.int64)
    ends = np.empty(len(starts), dtype=np.int64)
    line_offsets = np.empty(texts + 1, dtype=np.int64)
    k = 0
    for t in range(texts):
        line_offsets[t] = k
        i, end = offsets[t], offsets[t + 1]
        while i < end:
            first = i
            while i < end and not flags[cps[i]] & LINE_BREAK:
                i += 1
            if k == len(starts):
                starts, ends = _grow(starts), _grow(ends)
            starts[k], ends[k] = first, i
            k += 1
            if i < end:
                i += 2 if cps[i] == _CR and i + 1 < end and cps[i + 1] == _NEWLINE else 1
    line_offsets[texts] = k
    return starts[:k], ends[:k], line_offsets


@_compiled(inline="always")
def _frac(num: float, den: float) -> float:
    return num / den if den else 0.0


@_compiled(inline="always")
def _same(cps: np.ndarray, a: int, b: int, length: int) -> bool:
    for j in range(length):
        if cps[a + j] != cps[b + j]:
            return False
    return True


@_compiled(inline="always")
def _matches_at(text: np.ndarray, i: int, end: int, patterns: np.ndarray, p: int, p_end: int) -> bool:
    if i + (p_end - p) > end:
        return False
    for j in range(p_end - p):
        if text[i + j] != patterns[p + j]:
            return False
    return True


@_compiled()
def _contains(text: np.ndarray, start: int, end: int, patterns: np.ndarray, pattern_offsets: np.ndarray,
              which: int) -> bool:
    """Whether pattern `which` (patterns[pattern_offsets[which]:pattern_offsets[which + 1]]) is in text[start:end]."""
    p, p_end = pattern_offsets[which], pattern_offsets[which + 1]
    if p == p_end:
        return True
    for i in range(start, end - (p_end - p) + 1):
        if text[i] == patterns[p] and _matches_at(text, i, end, patterns, p, p_end):
            return True
    return False


@_compiled()
def _segment_hash(cps: np.ndarray, start: int, end: int) -> np.uint64:
    h = np.uint64(end - start)
    for i in range(start, end):
        h = h * _HASH_MULT + np.uint64(cps[i])
    return _fmix64(h)


@_compiled()
def _table(size: int, slot_hash: np.ndarray) -> bool:
    """Whether a table of len(slot_hash) slots is too small for `size` entries (it keeps half its slots free)."""
    return len(slot_hash) < 2 * size + 2


@_compiled()
def _new_table(size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(hash, start, length, value, stamp) slots, a power of two at least twice `size`; a slot is taken when its stamp
    is the current stamp, so a new stamp empties the table without a pass over it."""
    cap = 16
    while cap < 2 * size + 2:
        cap *= 2
    return (np.zeros(cap, np.uint64), np.zeros(cap, np.int64), np.zeros(cap, np.int64), np.zeros(cap, np.int64),
            np.zeros(cap, np.int64))


@_compiled(inline="always")
def _find_or_add(cps: np.ndarray, start: int, end: int, value: int, slot_hash: np.ndarray, slot_start: np.ndarray,
                 slot_len: np.ndarray, slot_value: np.ndarray, slot_stamp: np.ndarray, stamp: int) -> int:
    """The value of the entry equal to cps[start:end] (compared in full, not by its hash alone), or -1 after adding
    it with `value`."""
    h = _segment_hash(cps, start, end)
    mask = len(slot_hash) - 1
    slot = np.int64(h & np.uint64(mask))
    length = end - start
    while slot_stamp[slot] == stamp:
        if slot_hash[slot] == h and slot_len[slot] == length and _same(cps, slot_start[slot], start, length):
            return slot_value[slot]
        slot = (slot + 1) & mask
    slot_stamp[slot], slot_hash[slot], slot_start[slot], slot_len[slot], slot_value[slot] = stamp, h, start, length, value
    return -1


@_compiled(inline="always")
def _find_or_add_key(key: int, value: int, slot_hash: np.ndarray, slot_value: np.ndarray, slot_stamp: np.ndarray,
                     stamp: int) -> int:
    """The value stored for the integer `key`, or -1 after storing `value` for it."""
    mask = len(slot_hash) - 1
    h = np.uint64(key)
    slot = np.int64(_fmix64(h) & np.uint64(mask))
    while slot_stamp[slot] == stamp:
        if slot_hash[slot] == h:
            return slot_value[slot]
        slot = (slot + 1) & mask
    slot_stamp[slot], slot_hash[slot], slot_value[slot] = stamp, h, value
    return -1


# --------------------------------------------------------------------------------------------------
# gopher_quality: 1 word_count, 2 mean_word_length, 3 hash_ratio, 4 ellipsis_ratio, 5 bullet_lines,
# 6 ellipsis_lines, 7 alpha_words, 8 stop_words


@_compiled()
def gopher_quality(cps: np.ndarray, offsets: np.ndarray, flags: np.ndarray, active: np.ndarray,
                   tok_starts: np.ndarray, tok_ends: np.ndarray, tok_offsets: np.ndarray,
                   line_starts: np.ndarray, line_ends: np.ndarray, line_offsets: np.ndarray,
                   limits: np.ndarray, stop_words: np.ndarray, stop_offsets: np.ndarray) -> np.ndarray:
    """limits: min_doc_words, max_doc_words, min_avg_word_length, max_avg_word_length, max_symbol_word_ratio,
    max_bullet_lines_ratio, max_ellipsis_lines_ratio, min_alpha_words_ratio, min_stop_words."""
    out = np.zeros(len(offsets) - 1, dtype=np.int8)
    for t in range(len(out)):
        if active[t]:
            out[t] = _gopher_quality_one(cps, offsets[t], offsets[t + 1], flags, tok_starts, tok_ends,
                                         tok_offsets[t], tok_offsets[t + 1], line_starts, line_ends,
                                         line_offsets[t], line_offsets[t + 1], limits, stop_words, stop_offsets)
    return out


@_compiled()
def _gopher_quality_one(cps, start, end, flags, tok_starts, tok_ends, tok_first, tok_end, line_starts, line_ends,
                        line_first, line_end, limits, stop_words, stop_offsets) -> int:
    n_tokens = tok_end - tok_first
    n_words = word_chars = 0
    for k in range(tok_first, tok_end):
        if flags[cps[tok_starts[k]]] & WORD:
            n_words += 1
            word_chars += tok_ends[k] - tok_starts[k]
    if n_words < limits[0] or n_words > limits[1]:
        return 1
    mean_len = _frac(word_chars, n_words)
    if mean_len < limits[2] or mean_len > limits[3]:
        return 2
    if not np.isnan(limits[4]):
        hashes = ellipses = 0
        i = start
        while i < end:
            cp = cps[i]
            hashes += cp == _HASH
            ellipses += cp == _ELLIPSIS
            i += 1
        i = start
        while i + 3 <= end:  # str.count("..."): non-overlapping, left to right
            if cps[i] == _DOT and cps[i + 1] == _DOT and cps[i + 2] == _DOT:
                ellipses += 1
                i += 3
            else:
                i += 1
        if _frac(hashes, n_tokens) > limits[4]:
            return 3
        if _frac(ellipses, n_tokens) > limits[4]:
            return 4
    n_lines = line_end - line_first
    bullets = ellipsis_lines = 0
    for k in range(line_first, line_end):
        a, b = line_starts[k], line_ends[k]
        while a < b and flags[cps[a]] & SPACE:
            a += 1
        while b > a and flags[cps[b - 1]] & SPACE:
            b -= 1
        bullets += a < b and (cps[a] == _BULLET or cps[a] == _HYPHEN)
        ellipsis_lines += (b > a and cps[b - 1] == _ELLIPSIS) or (
            b - a >= 3 and cps[b - 1] == _DOT and cps[b - 2] == _DOT and cps[b - 3] == _DOT)
    if _frac(bullets, n_lines) > limits[5]:
        return 5
    if _frac(ellipsis_lines, n_lines) > limits[6]:
        return 6
    if not np.isnan(limits[7]):
        alpha = 0
        for k in range(tok_first, tok_end):
            for i in range(tok_starts[k], tok_ends[k]):
                if flags[cps[i]] & ALPHA:
                    alpha += 1
                    break
        if _frac(alpha, n_tokens) < limits[7]:
            return 7
    if not np.isnan(limits[8]):
        stops = 0
        for k in range(tok_first, tok_end):
            length = tok_ends[k] - tok_starts[k]
            for w in range(len(stop_offsets) - 1):
                p = stop_offsets[w]
                if stop_offsets[w + 1] - p == length and _matches_at(cps, tok_starts[k], tok_ends[k], stop_words, p,
                                                                     p + length):
                    stops += 1
                    break
        if stops < limits[8]:
            return 8
    return 0


# --------------------------------------------------------------------------------------------------
# gopher_repetition: 1 dup_para_frac, 2 dup_para_char_frac, 3 dup_line_frac, 4 dup_line_char_frac,
# 10 + n top_{n}gram or dup_{n}gram


@_compiled()
def gopher_repetition(cps: np.ndarray, offsets: np.ndarray, flags: np.ndarray, active: np.ndarray,
                      tok_starts: np.ndarray, tok_ends: np.ndarray, tok_offsets: np.ndarray, limits: np.ndarray,
                      ngram_limits: np.ndarray, ngram_top: np.ndarray) -> np.ndarray:
    """limits: dup_para_frac, dup_para_char_frac, dup_line_frac, dup_line_char_frac; ngram_limits[n] the n-gram
    check's limit (NaN: off), ngram_top[n] whether it is a top (else a dup) check; the highest n that is on is the
    last n-gram size computed."""
    texts = len(offsets) - 1
    out = np.zeros(texts, dtype=np.int8)
    max_n = 0
    for n in range(len(ngram_limits)):
        if not np.isnan(ngram_limits[n]):
            max_n = n
    most_tokens = 1
    for t in range(texts):
        most_tokens = max(most_tokens, tok_offsets[t + 1] - tok_offsets[t])
    scratch = np.empty((6, most_tokens + 1), dtype=np.int64)  # ids, keys, starts, new keys, counts, prefix
    seen = np.zeros(most_tokens + 1, dtype=np.bool_)
    segments = _new_table(16)
    pairs = _new_table(16)
    stamp = 0
    for t in range(texts):
        if not active[t] or offsets[t] == offsets[t + 1]:
            continue
        start, end = offsets[t], offsets[t + 1]
        newlines = 0
        for i in range(start, end):
            newlines += cps[i] == _NEWLINE
        if _table(newlines + 1, segments[0]):
            segments = _new_table(newlines + 1)
        stamp += 1
        code = _repeated_segments(cps, start, end, flags, limits, segments, stamp)  # stamps: this and the next
        stamp += 2
        if code or max_n < 2:
            out[t] = code
            continue
        n_tok = tok_offsets[t + 1] - tok_offsets[t]
        if _table(n_tok, segments[0]):
            segments = _new_table(n_tok)
        if _table(n_tok, pairs[0]):
            pairs = _new_table(n_tok)
        out[t] = _repeated_ngrams(cps, end - start, tok_starts, tok_ends, tok_offsets[t], n_tok, max_n, ngram_limits,
                                  ngram_top, scratch, seen, segments, pairs, stamp)
        stamp += max_n + 1
    return out


@_compiled()
def _repeated_segments(cps, start, end, flags, limits, table, stamp) -> int:
    """The paragraph (split on 2+ newlines of the stripped text) and line (split on newlines) checks."""
    slot_hash, slot_start, slot_len, slot_value, slot_stamp = table
    n_chars = end - start
    a, b = start, end
    while a < b and flags[cps[a]] & SPACE:
        a += 1
    while b > a and flags[cps[b - 1]] & SPACE:
        b -= 1
    paras = dup_paras = dup_para_chars = 0
    first = i = a
    while i <= b:
        if i < b and cps[i] != _NEWLINE:
            i += 1
            continue
        run = i
        while run < b and cps[run] == _NEWLINE:
            run += 1
        if i == b or run - i >= 2:
            paras += 1
            if _find_or_add(cps, first, i, 0, slot_hash, slot_start, slot_len, slot_value, slot_stamp, stamp) >= 0:
                dup_paras += 1
                dup_para_chars += i - first
            first = run
        if i == b:
            break
        i = run
    if dup_paras / paras > limits[0]:
        return 1
    if dup_para_chars / n_chars > limits[1]:
        return 2
    stamp += 1
    lines = dup_lines = dup_line_chars = 0
    first = i = start
    while i <= end:
        if i < end and cps[i] != _NEWLINE:
            i += 1
            continue
        lines += 1
        if _find_or_add(cps, first, i, 0, slot_hash, slot_start, slot_len, slot_value, slot_stamp, stamp) >= 0:
            dup_lines += 1
            dup_line_chars += i - first
        if i == end:
            break
        while i < end and cps[i] == _NEWLINE:
            i += 1
        first = i
        if i == end:  # the text ends with newlines: one more, empty, line
            lines += 1
            if _find_or_add(cps, i, i, 0, slot_hash, slot_start, slot_len, slot_value, slot_stamp, stamp) >= 0:
                dup_lines += 1
            break
    if dup_lines / lines > limits[2]:
        return 3
    if dup_line_chars / n_chars > limits[3]:
        return 4
    return 0


@_compiled()
def _repeated_ngrams(cps, n_chars, tok_starts, tok_ends, tok_first, n_tok, max_n, ngram_limits, ngram_top, scratch,
                     seen, tokens_table, pairs_table, stamp) -> int:
    """The n-gram checks, n = 2..max_n: each n extends only the positions whose (n-1)-gram repeats (an n-gram can
    repeat only there), with ids given in order of first occurrence as `stages.quality` gives them."""
    ids, keys, starts, new_keys, counts, prefix = scratch[0], scratch[1], scratch[2], scratch[3], scratch[4], scratch[5]
    t_hash, t_start, t_len, t_value, t_stamp = tokens_table
    p_hash, _, _, p_value, p_stamp = pairs_table
    distinct = 0
    prefix[0] = 0
    for j in range(n_tok):
        a, b = tok_starts[tok_first + j], tok_ends[tok_first + j]
        found = _find_or_add(cps, a, b, distinct, t_hash, t_start, t_len, t_value, t_stamp, stamp)
        if found < 0:
            found = distinct
            distinct += 1
        ids[j] = keys[j] = found
        starts[j] = j
        prefix[j + 1] = prefix[j] + b - a
    n_keys = n_tok
    for n in range(2, max_n + 1):
        stamp += 1
        keep = n_keys
        while keep > 0 and starts[keep - 1] > n_tok - n:
            keep -= 1
        distinct = 0
        for j in range(keep):
            pair = keys[j] * n_tok + ids[starts[j] + n - 1]
            found = _find_or_add_key(pair, distinct, p_hash, p_value, p_stamp, stamp)
            if found < 0:
                found = distinct
                counts[distinct] = 0
                distinct += 1
            new_keys[j] = found
            counts[found] += 1
        n_keys = 0
        for j in range(keep):
            if counts[new_keys[j]] > 1:
                keys[n_keys], starts[n_keys] = new_keys[j], starts[j]
                n_keys += 1
        limit = ngram_limits[n]
        if np.isnan(limit):
            continue
        chars = 0
        if ngram_top[n]:
            if n_keys:
                best = 0
                for key in range(1, distinct):
                    if counts[key] > counts[best]:  # ties: the first seen, as Counter.most_common
                        best = key
                j = 0
                while keys[j] != best:
                    j += 1
                i = starts[j]
                chars = (prefix[i + n] - prefix[i] + n - 1) * counts[best]
        else:
            seen[:distinct] = False
            resume = 0
            for j in range(n_keys):
                i = starts[j]
                if i < resume:
                    continue
                if seen[keys[j]]:
                    chars += prefix[i + n] - prefix[i]
                    resume = i + n
                else:
                    seen[keys[j]] = True
        if chars / n_chars > limit:
            return 10 + n
    return 0


# --------------------------------------------------------------------------------------------------
# c4: 1 lorem_ipsum, 2 curly_bracket, 3 too_few_sentences

# patterns of the c4 kernel, in this order
C4_PATTERNS = ("lorem ipsum", "javascript", "terms of use", "privacy policy", "cookie policy", "uses cookies",
               "use of cookies", "use cookies")


@_compiled()
def c4(cps: np.ndarray, offsets: np.ndarray, flags: np.ndarray, lower: np.ndarray, active: np.ndarray,
       line_starts: np.ndarray, line_ends: np.ndarray, line_offsets: np.ndarray, switches: np.ndarray,
       limits: np.ndarray, patterns: np.ndarray, pattern_offsets: np.ndarray) -> np.ndarray:
    """switches: remove_citations, filter_no_terminal_punct, filter_lorem_ipsum, filter_javascript,
    filter_curly_bracket, filter_policy; limits: min_words_per_line, max_word_length, min_num_sentences;
    patterns: `C4_PATTERNS`."""
    texts = len(offsets) - 1
    out = np.zeros(texts, dtype=np.int8)
    longest = 1
    for t in range(texts):
        longest = max(longest, offsets[t + 1] - offsets[t])
    line = np.empty(longest, dtype=np.uint32)
    lowered = np.empty(2 * longest, dtype=np.uint32)
    for t in range(texts):
        if not active[t]:
            continue
        sentences = 0
        for k in range(line_offsets[t], line_offsets[t + 1]):
            kept = _c4_line(cps, line_starts[k], line_ends[k], flags, lower, switches, limits, patterns,
                            pattern_offsets, line, lowered)
            if kept < 0:
                out[t] = -kept
                break
            sentences += kept
        if out[t] == 0 and sentences < limits[2]:
            out[t] = 3
    return out


@_compiled()
def _c4_line(cps, a, b, flags, lower, switches, limits, patterns, pattern_offsets, line, lowered) -> int:
    """The sentences a line adds (0 for a removed line), or minus the code of a check that drops the document."""
    while a < b and flags[cps[a]] & SPACE:
        a += 1
    while b > a and flags[cps[b - 1]] & SPACE:
        b -= 1
    words = 0
    i = a
    while i < b:  # str.split(): words before citations are removed
        while i < b and flags[cps[i]] & SPACE:
            i += 1
        first = i
        while i < b and not flags[cps[i]] & SPACE:
            i += 1
        if i > first:
            words += 1
            if i - first > limits[1]:
                return 0
    length = _without_citations(cps, a, b, flags, line) if switches[0] else _copy(cps, a, b, line)
    if switches[1]:
        last = line[length - 1] if length else 0
        if not (last == _DOT or last == 63 or last == 33 or last == 34 or last == 39):  # . ? ! " '
            return 0
        if length >= 3 and last == _DOT and line[length - 2] == _DOT and line[length - 3] == _DOT:
            return 0
    if words < limits[0]:
        return 0
    lowered_length = 0
    for i in range(length):
        cp = line[i]
        if cp == _DOTTED_CAPITAL_I:
            lowered[lowered_length] = 105  # "i", then U+0307
            lowered_length += 1
            lowered[lowered_length] = _COMBINING_DOT
        else:
            lowered[lowered_length] = lower[cp]
        lowered_length += 1
    if switches[2] and _contains(lowered, 0, lowered_length, patterns, pattern_offsets, 0):
        return -1
    if switches[3] and _contains(lowered, 0, lowered_length, patterns, pattern_offsets, 1):
        return 0
    if switches[4]:
        for i in range(length):
            if line[i] == _CURLY:
                return -2
    if switches[5]:
        for p in range(2, len(pattern_offsets) - 1):
            if _contains(lowered, 0, lowered_length, patterns, pattern_offsets, p):
                return 0
    return max(1, _sentence_ends(line, length, flags)) if length else 0


@_compiled()
def _copy(cps, a, b, line) -> int:
    line[: b - a] = cps[a:b]
    return b - a


@_compiled()
def _without_citations(cps, a, b, flags, line) -> int:
    """cps[a:b] into `line` without the matches of `\\[\\d*]|\\[edit]|\\[citation needed]`; its length."""
    length = 0
    i = a
    while i < b:
        if cps[i] == _OPEN_BRACKET:
            j = i + 1
            while j < b and flags[cps[j]] & DIGIT:
                j += 1
            if j < b and cps[j] == _CLOSE_BRACKET:
                i = j + 1
                continue
            skip = _citation_word(cps, i + 1, b)
            if skip:
                i += 1 + skip
                continue
        line[length] = cps[i]
        length += 1
        i += 1
    return length


@_compiled()
def _citation_word(cps, i, b) -> int:
    """How many code points "edit]" or "citation needed]" take at cps[i] (0: neither is there)."""
    for word in ("edit]", "citation needed]"):
        if i + len(word) <= b:
            same = True
            for j in range(len(word)):
                if cps[i + j] != ord(word[j]):
                    same = False
                    break
            if same:
                return len(word)
    return 0


@_compiled()
def _sentence_ends(line, length, flags) -> int:
    """Matches of `[.!?…]+['"”’)\\]]*(?:\\s+(?=[^\\sa-z])|\\s*$)` in line[:length], as re.findall counts them."""
    found = 0
    p = 0
    while p < length:
        cp = line[p]
        if not (cp == _DOT or cp == 33 or cp == 63 or cp == _ELLIPSIS):
            p += 1
            continue
        j = p
        while j < length and (line[j] == _DOT or line[j] == 33 or line[j] == 63 or line[j] == _ELLIPSIS):
            j += 1
        k = j
        while k < length and (line[k] == 39 or line[k] == 34 or line[k] == 0x201D or line[k] == 0x2019
                              or line[k] == 41 or line[k] == _CLOSE_BRACKET):  # ' " ” ’ ) ]
            k += 1
        m = k
        while m < length and flags[line[m]] & SPACE:
            m += 1
        if m == length or (m > k and not (97 <= line[m] <= 122)):
            found += 1
            p = m
        else:
            p = j  # every start inside the run ends at the same place, and fails the same way
    return found


# --------------------------------------------------------------------------------------------------
# fineweb: 1 line_punct_ratio, 2 short_line_ratio, 3 char_dup_ratio, 4 list_ratio


@_compiled()
def fineweb(cps: np.ndarray, offsets: np.ndarray, flags: np.ndarray, active: np.ndarray, tok_offsets: np.ndarray,
            limits: np.ndarray, exclude_zero: bool, short_line_length: int) -> np.ndarray:
    """limits: line_punct_thr, short_line_thr, char_duplicates_ratio, new_line_ratio."""
    texts = len(offsets) - 1
    out = np.zeros(texts, dtype=np.int8)
    table = _new_table(16)
    stamp = 0
    for t in range(texts):
        if not active[t]:
            continue
        start, end = offsets[t], offsets[t + 1]
        newlines = 0
        for i in range(start, end):
            newlines += cps[i] == _NEWLINE
        n_lines = newlines + 1
        if _table(n_lines, table[0]):
            table = _new_table(n_lines)
        stamp += 1
        slot_hash, slot_start, slot_len, slot_value, slot_stamp = table
        punct = short = dup_chars = 0
        first = start
        for i in range(start, end + 1):  # text.split("\n")
            if i < end and cps[i] != _NEWLINE:
                continue
            if i > first:
                last = cps[i - 1]
                punct += last == _DOT or last == 39 or last == 34 or last == 33 or last == 63  # . ' " ! ?
            short += i - first <= short_line_length
            blank = True
            for j in range(first, i):
                if not flags[cps[j]] & SPACE:
                    blank = False
                    break
            if not blank and not np.isnan(limits[2]):
                if _find_or_add(cps, first, i, 0, slot_hash, slot_start, slot_len, slot_value, slot_stamp, stamp) >= 0:
                    dup_chars += i - first
            first = i + 1
        ratio = punct / n_lines
        if ratio <= limits[0] and not (ratio == 0 and exclude_zero):
            out[t] = 1
        elif short / n_lines >= limits[1]:
            out[t] = 2
        elif _frac(dup_chars, (end - start) - newlines) >= limits[2]:
            out[t] = 3
        elif _frac(newlines, tok_offsets[t + 1] - tok_offsets[t]) > limits[3]:
            out[t] = 4
    return out


# --------------------------------------------------------------------------------------------------
# code: 1 max_line_length, 2 mean_line_length, 3 alphanum_fraction, 4 autogenerated,
# -1 autogenerated is Python's to decide (a marker holds a sigma and the head a capital sigma, whose lower() depends
# on the letters around it)


@_compiled()
def code(cps: np.ndarray, offsets: np.ndarray, flags: np.ndarray, lower: np.ndarray, active: np.ndarray,
         line_starts: np.ndarray, line_ends: np.ndarray, line_offsets: np.ndarray, limits: np.ndarray,
         scan_lines: int, markers: np.ndarray, marker_offsets: np.ndarray, markers_have_sigma: bool) -> np.ndarray:
    """limits: max_line_length, max_mean_line_length, min_alphanum_fraction."""
    texts = len(offsets) - 1
    out = np.zeros(texts, dtype=np.int8)
    longest = 1
    for t in range(texts):
        longest = max(longest, offsets[t + 1] - offsets[t])
    head = np.empty(2 * longest + 1, dtype=np.uint32)
    for t in range(texts):
        if not active[t]:
            continue
        first_line, end_line = line_offsets[t], line_offsets[t + 1]
        longest_line = total = 0
        for k in range(first_line, end_line):
            longest_line = max(longest_line, line_ends[k] - line_starts[k])
            total += line_ends[k] - line_starts[k]
        if longest_line > limits[0]:
            out[t] = 1
            continue
        if _frac(total, end_line - first_line) > limits[1]:
            out[t] = 2
            continue
        if not np.isnan(limits[2]):
            alnum = 0
            for i in range(offsets[t], offsets[t + 1]):
                alnum += (flags[cps[i]] & ALNUM) != 0
            if _frac(alnum, offsets[t + 1] - offsets[t]) < limits[2]:
                out[t] = 3
                continue
        if len(marker_offsets) > 1 and scan_lines > 0:
            length = 0
            sigma = False
            for k in range(first_line, min(end_line, first_line + scan_lines)):
                if k > first_line:
                    head[length] = _NEWLINE
                    length += 1
                for i in range(line_starts[k], line_ends[k]):
                    cp = cps[i]
                    sigma |= cp == _CAPITAL_SIGMA
                    if cp == _DOTTED_CAPITAL_I:
                        head[length] = 105
                        length += 1
                        head[length] = _COMBINING_DOT
                    else:
                        head[length] = lower[cp]
                    length += 1
            if sigma and markers_have_sigma:
                out[t] = -1
                continue
            for m in range(len(marker_offsets) - 1):
                if _contains(head, 0, length, markers, marker_offsets, m):
                    out[t] = 4
                    break
    return out
