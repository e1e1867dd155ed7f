"""Two jobs saving to one path while a third loads it (issue 21, items 1 and 2; docs/design.md
§9, "Concurrent saves"): counts mixed loads and lost checkpoints, which must both be 0.

Each writer process saves a JAX ZeRO checkpoint (``save_optimizer_state`` with model weights)
``--saves`` times to the same path; save ``i`` of writer ``w`` holds the value ``v = 1 + w +
WRITERS * i`` in every weight and every optimizer-state leaf, and ``step = v``. The reader
process loads the path continuously, alternating ``load_params`` and ``load_optimizer_state``:

- a **mixed** load returns values from two saves (leaves that differ, or a state whose values
  are not the manifest's step);
- a **lost** checkpoint is a save that failed (the other writer removed its files), or a
  moment at which ``PATH`` names no complete checkpoint: after a writer's save returned, or
  whenever the reader looks (it has existed since the first save); and at the end, ``PATH``
  must name one writer's last save with nothing else left beside it;
- a **retried** load is one refused with a sentence because a save removed the version it was
  reading (documented: load again); it is counted, never an error.

    python -m tests.faults.stress_concurrent_saves --saves 300

prints one JSON line of counts and exits 1 unless mixed, lost and errors are all 0.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from typing import Any

WRITERS = 2


def _problem() -> tuple[Any, Any]:
    # Imported here: the spawned process sets up JAX's fake devices on import of the worker.
    from tests.faults import jax_save_worker

    return jax_save_worker.problem()


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "manifest.json"))


def _writer(path: str, writer: int, saves: int, out: Any) -> None:
    import jax

    from gradsync_jax import save_optimizer_state

    tx, params = _problem()
    lost, last = [], None
    for i in range(saves):
        value = 1 + writer + WRITERS * i
        weights = jax.tree.map(lambda x, v=value: jax.numpy.full_like(x, v), params)
        state = jax.tree.map(lambda x, v=value: x + v, tx.init(weights))  # every leaf is v
        try:
            save_optimizer_state(path, tx, state, weights, step=value, model=weights)
        except ValueError as err:  # e.g. the other writer removed our staging directory
            lost.append(f"writer {writer} save {i} failed: {str(err)[:200]}")
            continue
        last = value
        if not _complete(path):  # our save returned: PATH must name a complete checkpoint
            lost.append(f"writer {writer} save {i}: {path} -> {os.readlink(path)} is gone")
    out.put({"writer": writer, "lost": lost, "last": last})


def _one_value(leaves: list[Any]) -> set[float]:
    import numpy as np

    return {float(v) for leaf in leaves for v in np.unique(np.asarray(leaf))}


def _load_once(path: str, tx: Any, params: Any, which: int) -> str:
    """One load: ``"ok"``, ``"mixed: ..."``, or ``"retried"`` (refused mid-save)."""
    import jax

    from gradsync_jax import load_optimizer_state, load_params

    try:
        if which % 2 == 0:
            values = _one_value(jax.tree.leaves(load_params(path, params)))
            return "ok" if len(values) == 1 else f"mixed: weights {sorted(values)}"
        state, manifest = load_optimizer_state(path, tx, params)
    except ValueError as err:
        # The version being read was removed by a save: a sentence, load again.
        if str(err).endswith("was removed by a later save while it was being read; load again"):
            return "retried"
        raise
    values = _one_value(jax.tree.leaves(state))
    if values != {float(manifest.step)}:
        return f"mixed: state {sorted(values)} under step {manifest.step}"
    return "ok"


def _reader(path: str, stop: Any, out: Any) -> None:
    import optax

    _, params = _problem()
    tx = optax.adam(1e-2)  # the whole state, unsharded: no padding to tell apart
    counts = {"ok": 0, "retried": 0, "mixed": 0, "lost": 0, "errors": 0}
    notes: list[str] = []
    while not os.path.lexists(path) and not stop.is_set():
        time.sleep(0.01)
    loads = 0
    while not stop.is_set():
        if not _complete(path):
            counts["lost"] += 1
            if len(notes) < 20:
                notes.append(f"{path} names no complete checkpoint")
            time.sleep(0.001)
            continue
        try:
            outcome = _load_once(path, tx, params, loads)
        except Exception as err:
            outcome = f"error: {type(err).__name__}: {err}"
        loads += 1
        kind = outcome.partition(":")[0]
        counts["errors" if kind == "error" else kind] += 1
        if kind in ("mixed", "error") and len(notes) < 20:
            notes.append(outcome)
    out.put({"reader": counts, "notes": notes})


def _leftovers(path: str) -> list[str]:
    parent, base = os.path.split(path)
    current = os.readlink(path)
    return sorted(n for n in os.listdir(parent) if n.startswith(f"{base}.") and n != current)


def run(saves: int, directory: str) -> dict[str, Any]:
    """Run two writers of ``saves`` saves each and one reader on ``directory/ckpt``."""
    path = os.path.join(directory, "ckpt")
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    reader = ctx.Process(target=_reader, args=(path, stop, out))
    writers = [ctx.Process(target=_writer, args=(path, w, saves, out)) for w in range(WRITERS)]
    start = time.monotonic()
    for p in [reader, *writers]:
        p.start()
    results = [out.get(timeout=3600) for _ in writers]
    stop.set()
    results.append(out.get(timeout=600))
    for p in [reader, *writers]:
        p.join(timeout=60)
    counts = next(r["reader"] for r in results if "reader" in r)
    lost = [note for r in results for note in r.get("lost", [])]
    lasts = {r["last"] for r in results if "writer" in r}
    final = {"final": None, "left": []}
    if _complete(path):
        with open(os.path.join(path, "manifest.json")) as f:
            final = {"final": json.load(f).get("step"), "left": _leftovers(path)}
    if final["final"] not in lasts or final["left"]:
        lost.append(f"at the end: {path} holds step {final['final']}, left {final['left']}")
    notes = [note for r in results for note in r.get("notes", [])]
    return {
        "saves": saves * WRITERS,
        "loads": sum(counts[k] for k in ("ok", "retried", "mixed", "errors")),
        **{k: counts[k] for k in ("ok", "retried", "mixed", "errors")},
        "lost": counts["lost"] + len(lost),
        "seconds": round(time.monotonic() - start, 1),
        "notes": (lost + notes)[:20],
    }


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--saves N`` per writer; prints the counts as one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--saves", type=int, default=300, help="saves per writer (default 300)")
    parser.add_argument("--dir", help="where to save (default: a new temporary directory)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        result = run(args.saves, directory)
    print(json.dumps(result))
    return 0 if result["mixed"] == result["lost"] == result["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
