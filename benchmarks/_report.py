"""Repeat a benchmark's whole measurement and report the spread of its ratios (docs/design.md §11).

One load spike on a shared machine can move a single run's ratio by 10 %; the median and the
range over several runs of the same process tree show whether a difference is real. Every
script in ``benchmarks/`` uses this module the same way::

    add_repeat_arg(parser)
    runs = run_repeats(lambda index: measure(args), args.repeat)
    finish(runs, ratio_keys=("ratio_vs_anchor", "paired_ratio_vs_anchor"))

``measure`` prints its human-readable table and returns one flat dict (the JSON object a single
run printed before). ``finish`` prints the spread of each ratio and the last line: ONE JSON
object with the per-run figures merged (floats: the median over the runs) and, for every ratio
key ``<name>_vs_anchor``, ``<name>_median``, ``<name>_min``, ``<name>_max`` and ``<name>s``
(each run's value), plus ``"repeats"``. So ``ratio_vs_anchor`` yields ``ratio_median``,
``ratio_min``, ``ratio_max`` and ``ratios``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from typing import Any

Figures = dict[str, Any]


def add_repeat_arg(parser: argparse.ArgumentParser) -> None:
    """Add ``--repeat N`` (default 1): how many times the whole measurement runs."""
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run the whole measurement N times; report the median and range of each ratio",
    )


def run_repeats(measure: Callable[[int], Figures], repeats: int) -> list[Figures]:
    """Call ``measure(index)`` ``repeats`` times, announcing each run when there are several.

    Raises:
        ValueError: ``repeats`` is below 1.
    """
    if repeats < 1:
        raise ValueError(f"--repeat must be at least 1, got {repeats}")
    runs = []
    for index in range(repeats):
        if repeats > 1:
            print(f"--- repeat {index + 1} of {repeats} ---", flush=True)
        runs.append(measure(index))
    return runs


def ratio_stem(key: str) -> str:
    """``"zero2_ratio_vs_anchor"`` -> ``"zero2_ratio"``: the prefix of the summary keys."""
    return key.removesuffix("_vs_anchor")


def _merge(values: list[Any]) -> Any:
    """One value for a figure over the runs: equal values stay, floats take their median,
    flags must hold in every run, dicts merge key by key."""
    first = values[0]
    if all(v == first for v in values):
        return first
    if all(isinstance(v, bool) for v in values):
        return all(values)
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return round(statistics.median(values), 6)
    if all(isinstance(v, dict) for v in values):
        return {k: _merge([v.get(k) for v in values]) for k in first}
    return values  # nothing sensible to merge: keep every run's value


def summarize(
    runs: Sequence[Figures], ratio_keys: Sequence[str], largest_keys: Sequence[str] = ()
) -> Figures:
    """The merged figures of ``runs`` plus the median, range and list of each ratio key.

    ``largest_keys`` are worst cases (a largest difference): they keep the largest value
    over the runs instead of the median.

    Raises:
        KeyError: a ratio key missing from a run (a ratio the script did not measure).
    """
    merged: Figures = {key: _merge([run.get(key) for run in runs]) for key in runs[0]}
    for key in largest_keys:
        merged[key] = max(run[key] for run in runs)
    merged["repeats"] = len(runs)
    for key in ratio_keys:
        ratios = [float(run[key]) for run in runs]
        stem = ratio_stem(key)
        merged[f"{stem}_median"] = round(statistics.median(ratios), 4)
        merged[f"{stem}_min"] = round(min(ratios), 4)
        merged[f"{stem}_max"] = round(max(ratios), 4)
        merged[f"{stem}s"] = [round(r, 4) for r in ratios]
    return merged


def finish(
    runs: Sequence[Figures], ratio_keys: Sequence[str], largest_keys: Sequence[str] = ()
) -> Figures:
    """Print each ratio's spread over the runs, then the one-line JSON object; return it."""
    merged = summarize(runs, ratio_keys, largest_keys)
    if len(runs) > 1:
        print(f"over {len(runs)} repeats (median, range min-max, each repeat):")
        for key in ratio_keys:
            stem = ratio_stem(key)
            each = ", ".join(f"{r:.3f}" for r in merged[f"{stem}s"])
            print(
                f"  {key:<34} {merged[f'{stem}_median']:.3f}x "
                f"[{merged[f'{stem}_min']:.3f}-{merged[f'{stem}_max']:.3f}]  ({each})"
            )
    print(json.dumps(merged), flush=True)
    return merged
