"""The embedded default corpus for `datapipe run`: real text that any machine with Python carries.

- `code`:   the Python standard library's `.py` files (site-packages and test data left out);
- `prose`:  the standard library's docstrings, one document per module;
- `manual`: the system's manual pages rendered to plain text (`man -l`), `lang` = the man folder
            (`en` for the top level), a bounded, deterministic selection so it renders in about a
            minute on 2 cores; left out where the machine has no manual pages or no `man`.

The three JSONL files are built once into a cache folder (`cache_dir()`, atomically) and reused.
"""

from __future__ import annotations

import ast
import gzip
import itertools
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import orjson

from datapipe.core.shards import atomic_write_bytes

MAN_ROOT = Path("/usr/share/man")
_SECTION = re.compile(r"^man[1-9n][a-z]*$")
_OVERSTRIKE = re.compile(r".\x08")
_SGR = re.compile(r"\x1b\[[0-9;]*m")
_ANSI_LANG = re.compile(r"^[a-z]{2,3}(_[A-Z]{2})?$")


def cache_dir() -> Path:
    """Where the corpus is built (about 25 MB): `$DATAPIPE_CACHE_DIR/embedded`, the folder of every datapipe
    cache; without it `$XDG_CACHE_HOME/datapipe/embedded`, else `~/.cache/datapipe/embedded`."""
    root = os.environ.get("DATAPIPE_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "datapipe"
    return Path(root) / "embedded"


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "lib2to3"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return files


def _code_and_prose() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    code, prose = [], []
    for path in _stdlib_files():
        rel = str(path.relative_to(root))
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        code.append({"id": f"code/{rel}", "text": source, "lang": "python"})
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        docs = [
            d
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and (d := ast.get_docstring(node))
        ]
        text = "\n\n".join(docs)
        if len(text) >= 200:
            prose.append({"id": f"prose/{rel}", "text": text, "lang": "en"})
    return code, prose


def _man_pages(limit: int) -> list[tuple[Path, str]]:
    """(path, language) for up to `limit` pages: translated pages first (they are few and they are
    the multilingual part), one language after another, then English pages spread evenly."""
    if not MAN_ROOT.is_dir() or shutil.which("man") is None:
        return []
    english, other = [], []
    for lang_dir in sorted(MAN_ROOT.iterdir()):
        if _SECTION.match(lang_dir.name):
            lang, sections = "en", [lang_dir]
        elif _ANSI_LANG.match(lang_dir.name.split(".")[0]) and lang_dir.is_dir():
            lang, sections = lang_dir.name.split(".")[0], [d for d in sorted(lang_dir.iterdir()) if _SECTION.match(d.name)]
        else:
            continue
        for section in sections:
            for page in sorted(section.iterdir()):
                if page.is_file() and not page.is_symlink():
                    (english if lang == "en" else other).append((page, lang))
    # Round-robin over languages, so that even a small limit spans many of them.
    by_lang: dict[str, list[tuple[Path, str]]] = {}
    for page, lang in other:
        by_lang.setdefault(lang, []).append((page, lang))
    interleaved = [p for group in itertools.zip_longest(*by_lang.values()) for p in group if p is not None]
    chosen = interleaved[:limit]
    room = limit - len(chosen)
    if room > 0 and english:
        step = max(1, len(english) // room)
        chosen += english[::step][:room]
    return chosen


def _is_alias_stub(path: Path) -> bool:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            head = f.read(200)
    except OSError:
        return True
    return head.lstrip().startswith(b".so ")


def render_man(path: Path) -> str | None:
    """A manual page as plain text, or None when it cannot be rendered within 30 s."""
    if _is_alias_stub(path):
        return None
    env = {**os.environ, "MANWIDTH": "80", "LC_ALL": "C.UTF-8", "MAN_KEEP_FORMATTING": "", "MANPAGER": "cat", "PAGER": "cat"}
    try:
        proc = subprocess.run(
            ["man", "--nh", "--nj", "-l", str(path)], capture_output=True, timeout=30, env=env, start_new_session=True
        )
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    text = _SGR.sub("", _OVERSTRIKE.sub("", proc.stdout.decode("utf-8", "replace")))
    return "\n".join(line.rstrip() for line in text.splitlines()).strip()


def _manual(limit: int, workers: int) -> Iterator[dict[str, Any]]:
    pages = _man_pages(limit)
    with ThreadPoolExecutor(workers) as pool:
        for (path, lang), text in zip(pages, pool.map(lambda p: render_man(p[0]), pages)):
            if text:
                rel = path.relative_to(MAN_ROOT)
                yield {"id": f"man/{rel}", "text": text, "lang": lang}


def _write_jsonl(path: Path, records: Any) -> int:
    lines = [orjson.dumps(r) + b"\n" for r in records]
    atomic_write_bytes(path, b"".join(lines))
    return len(lines)


def prepare(man_pages: int = 1500, *, log=print) -> dict[str, Path]:
    """Build (or reuse) the embedded corpus; returns {domain: JSONL path}."""
    folder = cache_dir() / f"v2-py{sys.version_info.major}{sys.version_info.minor}-man{man_pages}"
    paths = {"code": folder / "code.jsonl", "prose": folder / "prose.jsonl", "manual": folder / "manual.jsonl"}
    if not (paths["code"].exists() and paths["prose"].exists()):
        code, prose = _code_and_prose()
        log(f"embedded corpus: {len(code)} stdlib files (code), {len(prose)} docstring documents (prose)")
        _write_jsonl(paths["code"], code)
        _write_jsonl(paths["prose"], prose)
    if not paths["manual"].exists():
        log(f"embedded corpus: rendering up to {man_pages} manual pages with `man` ...")
        n = _write_jsonl(paths["manual"], _manual(man_pages, os.cpu_count() or 2))
        log(f"embedded corpus: {n} manual pages")
    if paths["manual"].stat().st_size == 0:
        del paths["manual"]
    return paths
