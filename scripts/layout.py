"""docs/layout.md's listing, generated from the tree: every package and module with the first sentence of its
docstring. `python -m scripts.layout` prints it with line counts per wing; `--write` rewrites the listing between
its markers; tests/test_architecture.py fails when docs/layout.md and the tree disagree."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUT_DOC = "docs/layout.md"
BEGIN, END = "<!-- layout:begin (python -m scripts.layout --write) -->", "<!-- layout:end -->"
TOPS = ("datapipe", "stages")


def _summary(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.match(r"(.+?[.])(\s|$)", first)
    return (m.group(1) if m else first).rstrip(":.") or "(no docstring)"


def _entries(folder: Path, depth: int) -> list[str]:
    lines = []
    for path in sorted(folder.iterdir(), key=lambda p: (p.is_dir(), p.name)):
        if path.name.startswith(("_", ".")) or path.name == "recipes":
            continue
        if path.is_dir() and (path / "__init__.py").exists():
            lines.append(f"{'  ' * depth}{path.name}/  {_summary(path / '__init__.py')}")
            lines += _entries(path, depth + 1)
        elif path.suffix == ".py":
            lines.append(f"{'  ' * depth}{path.name}  {_summary(path)}")
    return lines


def render() -> str:
    lines = []
    for top in TOPS:
        lines.append(f"{top}/  {_summary(ROOT / top / '__init__.py')}")
        lines += _entries(ROOT / top, 1)
    return "```\n" + "\n".join(lines) + "\n```"


def readme_section(text: str) -> str | None:
    if BEGIN not in text or END not in text:
        return None
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()


def line_counts() -> dict[str, int]:
    counts: dict[str, int] = {}
    for top in TOPS:
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT).parts
            wing = "/".join(rel[:2]) if top == "datapipe" and len(rel) > 2 else top if top == "stages" else "datapipe (top)"
            counts[wing] = counts.get(wing, 0) + len(path.read_text().splitlines())
    return dict(sorted(counts.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--write", action="store_true", help="rewrite docs/layout.md's listing")
    args = ap.parse_args()
    section = render()
    if args.write:
        readme = ROOT / LAYOUT_DOC
        text = readme.read_text()
        if readme_section(text) is None:
            raise SystemExit(f"{LAYOUT_DOC} has no {BEGIN} … {END} markers")
        a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
        readme.write_text(text[:a] + "\n" + section + "\n" + text[b:])
    print(section)
    for wing, n in line_counts().items():
        print(f"{n:6d}  {wing}")


if __name__ == "__main__":
    main()
