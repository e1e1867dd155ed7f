"""A JAX ZeRO-3 load reads only what each process keeps (issue 34, item 4; docs/jax-zero3.md).

2 processes x 4 CPU devices (``jax.distributed`` on 127.0.0.1) save a ZeRO-3 AdamW state of an
MLP over the 8 devices and load it back, every read of a checkpoint file counted
(tests/jax/checkpoint_reads_worker.py). Each process must read, besides the hashes of its
share of the files, exactly: the manifest, every rank file's header (and again for each file
it hashes: the rank it records), and the rows its 4 devices hold of every weight and moment.
That is at most half the checkpoint's tensors plus one parameter (the embedding's 100 rows
do not split evenly), plus the manifest and headers; together the processes hash every file
once, and agree on the outcome: a file changed where only one process hashes it fails the
load on both. Before, every process hashed every file twice and read every file whole, the
files holding the weights twice: 3.4 times the checkpoint per process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.jax import checkpoint_reads_worker as worker
from tests.jax.distributed_start import launch

PROCESSES, LOCAL_DEVICES = 2, 4


def _launch(out: Path) -> list[dict]:
    launch(worker.__file__, out, PROCESSES, str(LOCAL_DEVICES))
    return [json.loads((out / f"reads_{i}.json").read_text()) for i in range(PROCESSES)]


@pytest.mark.slow
def test_each_process_reads_its_rows_and_hashes_its_share(tmp_path: Path) -> None:
    records = _launch(tmp_path)
    files = records[0]["files"]
    tensors = sum(sum(f["tensors"].values()) for f in files.values())
    headers = sum(f["header"] for f in files.values())
    by_param: dict[str, int] = {}  # every tensor of a parameter: its weight and moments
    for f in files.values():
        for key, size in f["tensors"].items():
            name = key.partition("/")[2] if key.startswith("__model__/") else key.rpartition("/")[0]
            by_param[name] = by_param.get(name, 0) + size
    hashed: list[str] = []
    for r in records:
        assert r["same"], f"process {r['process']} did not load the saved state bitwise"
        other, mine = dict(r["other"]), sorted(r["hash"])
        hashed += mine
        manifest = other.pop("manifest.json")
        read = sum(other.values())
        # The target: at most 1/N of the state plus one parameter, plus the headers (each
        # read once, and again for the files this process hashes).
        bound = tensors / PROCESSES + max(by_param.values()) + 2 * headers
        assert read <= bound, f"process {r['process']} read {read} bytes, more than {bound}"
        # Exactly: every header, the headers of the files it hashes, its devices' rows.
        assert read == headers + sum(files[n]["header"] for n in mine) + r["held"]
        assert manifest == r["manifest"], "the manifest is read once"
        # The hash check reads each of its files whole, once.
        assert r["hash"] == {name: files[name]["size"] for name in mine}
    assert sorted(hashed) == sorted(files), "together the processes hash every file once"
    # A byte changed in a file only process 1 hashes, of which process 0 reads rows: the
    # processes agree, so process 0 refuses what it alone would have taken.
    assert "rank-00001-of-00008.safetensors" in records[1]["hash"]
    for r in records:
        assert r["refused"].startswith("CheckpointError: cannot load ZeRO-3 checkpoint "), r
        assert "(process 1): checkpoint file " in r["refused"], r["refused"]
        assert "rank-00001-of-00008.safetensors does not match its manifest hash" in r["refused"]
