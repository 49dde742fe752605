"""The documentation holds together: every relative link in README.md, BENCHMARKS.md and docs/*.md names a file
that exists and, with a #fragment, a heading of that file (GitHub's anchors); no heading and no file name is named
after an issue number ("issue 23", "(issue 7)", "issue15_…")."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
ISSUE = re.compile(r"issues?[\s_-]*\d", re.I)

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _prose(text: str) -> str:
    """The text without fenced blocks and code spans: a link inside code is not a link."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def headings(text: str) -> list[str]:
    """The ATX headings (`#` to `######`) outside fenced blocks, as written."""
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", _FENCE.sub("", text), re.M)]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text without markup, lower case, punctuation dropped (letters, digits,
    `_`, `-` and spaces stay), spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a page offers: its headings' slugs, a repeated one numbered -1, -2, ... as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(text):
        base = slug(heading)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def links(text: str) -> list[str]:
    return [m.group(1) for m in _LINK.finditer(_prose(text))]


def test_slugs_are_githubs():
    assert slug("Cost model: 1 TB, 1 B documents, 256 cores") == "cost-model-1-tb-1-b-documents-256-cores"
    assert slug("The driver's bookkeeping on 102 k blocks") == "the-drivers-bookkeeping-on-102-k-blocks"
    assert slug("Scaling with the corpus: 0.625 M to 10 M documents") == "scaling-with-the-corpus-0625-m-to-10-m-documents"
    assert slug("`datapipe stats` and **more**") == "datapipe-stats-and-more"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n### A\n") == {"a", "a-1", "a-2"}
    assert links("[x](a.md#b) `[y](c.md)` ![z](p.png)\n```\n[w](d.md)\n```\n") == ["a.md#b", "p.png"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    text = page.read_text()
    broken = []
    for target in links(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...: not a file of this repository
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {path}")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file.read_text()):
            broken.append(f"{target}: no heading with the anchor #{fragment} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_links_every_docs_page():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links((ROOT / "README.md").read_text())}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


def test_no_heading_is_named_after_an_issue():
    named = [(p.relative_to(ROOT), h) for p in PAGES for h in headings(p.read_text()) if ISSUE.search(h)]
    assert not named, named


def _repository_files() -> list[str]:
    try:
        done = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    except OSError:
        done = None
    if done is not None and done.returncode == 0:
        return [f for f in done.stdout.splitlines() if (ROOT / f).exists()]
    skip = {".git", "__pycache__", ".pytest_cache", ".import_linter_cache", "out", "runs", "build"}
    return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
            if p.is_file() and not skip.intersection(p.relative_to(ROOT).parts) and ".egg-info" not in str(p)]


def test_no_file_is_named_after_an_issue():
    named = [f for f in _repository_files() if any(ISSUE.search(part) for part in Path(f).parts)]
    assert not named, named


def test_the_readme_is_a_way_in_of_at_most_200_lines_with_python_near_the_top():
    """README.md is the way in and docs/ the reference: it stays within 200 lines, shows the Python use in its first
    60 lines, and its Test paragraph gives the suite one time, with its date."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200, f"README.md has {len(text.splitlines())} lines: move detail into docs/"
    assert "```python" in "\n".join(text.splitlines()[:60]), "README.md's Python example left its top"
    test = text.split("\n## Test\n")[1].split("\n## ")[0]
    assert len(re.findall(r"\d+ min(?:utes)?(?: \d+ s\b)?|\b\d+ s\b", test)) == 1, test
