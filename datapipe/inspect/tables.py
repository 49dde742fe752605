"""The one plain-text table renderer of the inspect wing (stats tables and the curate summary)."""

from __future__ import annotations

from typing import Any


def table(header: list[str], rows: list[list[Any]], *, left: int = 2) -> str:
    """A plain aligned table: the first `left` columns left-aligned, the rest right-aligned;
    ints get thousands separators, None prints as '-'."""
    cells = [header] + [["-" if c is None else f"{c:,}" if isinstance(c, int) and not isinstance(c, bool) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for n, r in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
