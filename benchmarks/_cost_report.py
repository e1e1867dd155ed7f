"""``cost_model.py``'s table: predicted against measured per row, the errors' median and
worst, and whether each group's first choice (``rank_key``'s order) is the fastest measured."""

from __future__ import annotations

import json
import statistics
from typing import Any

from gradsync_core.plan import rank_key


def _error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def report(rows: list[dict[str, Any]], *, json_line: bool = True) -> dict[str, Any]:
    """Print the table and the summary (then, with ``json_line``, all of it as one JSON line)."""
    print(
        f"{'framework':<10} {'configuration':<32} {'compute':>8} {'pred ms':>8} {'meas ms':>8} "
        f"{'err':>7} {'pred MiB':>9} {'meas MiB':>9} {'err':>7} plan"
    )
    for row in rows:
        row["step_error"] = _error(row["predicted_step_s"], row["step_s"])
        row["peak_error"] = _error(row["predicted_peak_bytes"], row["peak_bytes"])
        print(
            f"{row['framework']:<10} {row['label']:<32} {row['predicted_compute_s'] * 1e3:>8.1f} "
            f"{row['predicted_step_s'] * 1e3:>8.1f} "
            f"{row['step_s'] * 1e3:>8.1f} {row['step_error']:>+7.1%} "
            f"{row['predicted_peak_bytes'] / 2**20:>9.1f} {row['peak_bytes'] / 2**20:>9.1f} "
            f"{row['peak_error']:>+7.1%} {'same' if row['plan_match'] else 'DIFFERENT'}"
        )
    for group in sorted({r["framework"] for r in rows}):
        plain = next(r["compute_only_s"] for r in rows if r["framework"] == group)
        print(
            f"{group}: a plain step without communication (largest microbatch) {plain * 1e3:.1f} ms"
        )
        first = next(r for r in rows if r["framework"] == group)
        if first.get("host_s") or first.get("step_host_s"):
            host = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(first["host_s"].items()))
            step = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(first["step_host_s"].items()))
            print(f"{group}: host ms per collective: {host}; per step: {step}")
        if first.get("overlap_slowdowns"):
            slow = ", ".join(f"{k} {v:.3g}" for k, v in sorted(first["overlap_slowdowns"].items()))
            print(f"{group}: compute's slowdown beside a collective: {slow}")
    steps = [abs(r["step_error"]) for r in rows]
    peaks = [abs(r["peak_error"]) for r in rows]
    out: dict[str, Any] = {
        "bench": "cost_model",
        "configurations": len(rows),
        "median_step_error": round(statistics.median(steps), 4),
        "worst_step_error": round(max(steps), 4),
        "median_peak_error": round(statistics.median(peaks), 4),
        "worst_peak_error": round(max(peaks), 4),
    }
    for group in sorted({r["framework"] for r in rows}):
        mine = [r for r in rows if r["framework"] == group]
        chosen = min(
            mine,
            key=lambda r: rank_key(r["predicted_step_s"], r["predicted_peak_bytes"], mine.index(r)),
        )
        fastest = min(mine, key=lambda r: r["step_s"])
        gap = chosen["step_s"] / fastest["step_s"] - 1
        print(
            f"{group}: first choice {chosen['label']!r} measured {chosen['step_s'] * 1e3:.1f} ms; "
            f"fastest measured {fastest['label']!r} {fastest['step_s'] * 1e3:.1f} ms ({gap:+.1%})"
        )
        out[f"search_gap {group}"] = round(gap, 4)
    out["search_first_within_5pct"] = all(
        v <= 0.05 for k, v in out.items() if k.startswith("search_gap")
    )
    out["rows"] = rows
    if json_line:
        print(json.dumps(out), flush=True)
    return out
