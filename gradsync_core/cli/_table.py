"""Text tables of the ``gradsync`` command line: right-aligned columns, long tables cut."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gradsync_core.plan._buckets import MIB


def mib(nbytes: float) -> str:
    """Bytes as MiB with two decimals and thousands separators."""
    return f"{nbytes / MIB:,.2f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], max_rows: int = 40) -> str:
    """Right-aligned columns under a dashed rule; past ``max_rows`` the middle becomes '...'."""
    shown_rows: list[Sequence[Any]] = list(rows)
    if len(rows) > max_rows:
        half = max_rows // 2
        shown_rows = [*rows[:half], ["..."] * len(headers), *rows[-half:]]
    cells = [[str(c) for c in row] for row in [headers, *shown_rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def shown(count: int, limit: int) -> list[int]:
    """Indices a table shows: all of them, or the first and last ``limit // 2``."""
    if count <= limit:
        return list(range(count))
    return [*range(limit // 2), *range(count - limit // 2, count)]
