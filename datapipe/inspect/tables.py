"""The one table renderer of the inspect wing: cells as text (terminal and HTML alike) and plain aligned tables."""

from __future__ import annotations

from typing import Any


def cell(value: Any) -> str:
    """One table cell as text, the same in the terminal and on the HTML page: ints get thousands
    separators, floats one decimal (callers pre-format figures that need other precision), None is '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return str(value)


def table(header: list[str], rows: list[list[Any]], *, left: int = 2) -> str:
    """A plain aligned table: the first `left` columns left-aligned, the rest right-aligned; cells as `cell` writes them."""
    cells = [header] + [[cell(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for n, r in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
