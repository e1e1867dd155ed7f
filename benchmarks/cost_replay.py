"""Predict the rows of saved ``cost_model.py`` runs again, with the cost model as it is now.

``python benchmarks/cost_model.py --save run.json`` keeps, beside each row's measured step
and peak, the machine profile and the model profile its prediction read. This script predicts
every row again from those two profiles (``gradsync_core`` only: no rank, no device runs) and
prints ``cost_model.py``'s table, so a change to the model is checked against the runs
already measured before a new measurement: one table per file, then the median and worst
over them all. What it cannot do is measure: a change it favours still needs fresh runs.

    python benchmarks/cost_replay.py run1.json run2.json run3.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _cost_report import report

from gradsync_core.plan import Configuration, MachineProfile, ModelProfile, ParamSpec, predict


def specs(layers: int, width: int) -> list[ParamSpec]:
    """The benchmark's model: ``layers`` blocks of ``Linear(width, width)``, a weight before
    its bias (both executors' order)."""
    return [
        ParamSpec(name=f"layers.{i}.fc.{name}", shape=shape)
        for i in range(layers)
        for name, shape in (("weight", (width, width)), ("bias", (width,)))
    ]


def replay(saved: dict[str, Any]) -> list[dict[str, Any]]:
    """The saved rows, each predicted again from the profiles it read."""
    model_specs = specs(saved["layers"], saved["width"])
    rows = []
    for row in saved["rows"]:
        framework = row["framework"]  # "torch x2", "jax x8"
        executor, world = framework.split(" x")
        inputs = row["inputs"]
        p = predict(
            model_specs,
            Configuration(**row["configuration"]),
            world_size=int(world),
            machine=MachineProfile.from_json(inputs["machine"]),
            model=ModelProfile.from_json(inputs["model"]),
            global_batch=saved["global_batch"],
            executor=executor,
        )
        out = {k: v for k, v in row.items() if k != "inputs"}
        out.update(
            predicted_step_s=p.step_s,
            predicted_compute_s=p.cost.compute_s,
            predicted_exposed_s=p.cost.exposed_comm_s,
            predicted_peak_bytes=p.peak_bytes,
        )
        rows.append(out)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="files cost_model.py --save wrote")
    args = parser.parse_args(argv)
    summaries = []
    for path in args.files:
        with open(path) as f:
            saved = json.load(f)
        print(f"== {path}")
        summaries.append(report(replay(saved), json_line=False))
    steps = [s["median_step_error"] for s in summaries]
    worst = [s["worst_step_error"] for s in summaries]
    out = {
        "bench": "cost_replay",
        "files": len(summaries),
        "median_step_error": steps,
        "worst_step_error": worst,
        "worst_peak_error": [s["worst_peak_error"] for s in summaries],
        "search_first_within_5pct": [s["search_first_within_5pct"] for s in summaries],
        "median_of_medians": round(statistics.median(steps), 4),
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
