"""A gradsync checkpoint written with the standard library (no torch, no JAX), for the core's
command line and the hostile-file tests."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from gradsync_core import Manifest, ParamSpec, plan_greedy_shards
from gradsync_core.checkpoint import rank_file, write_manifest


def safetensors_bytes(tensors: dict[str, list[float]]) -> bytes:
    """A float32 safetensors file, written with the standard library as the format says:
    8-byte little-endian header length, JSON header, then the bytes."""
    header, body = {}, b""
    for key, values in tensors.items():
        data = struct.pack(f"<{len(values)}f", *values)
        header[key] = {
            "dtype": "F32",
            "shape": [len(values)],
            "data_offsets": [len(body), len(body) + len(data)],
        }
        body += data
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def write_checkpoint(
    directory: Path,
    position: dict[str, Any] | None = None,
    layout: dict[str, Any] | None = None,
) -> tuple[Any, dict[str, int]]:
    """A 2-rank greedy Adam checkpoint of a 3-parameter model, with one model weight (and the
    data position ``position``, a cursor's JSON, and the ``layout`` record, if given),
    written in ``directory``.

    Returns:
        The shard plan and each parameter's owning rank.
    """
    specs = [
        ParamSpec(name="fc.weight", shape=(4,)),
        ParamSpec(name="fc.bias", shape=(2,)),
        ParamSpec(name="emb.weight", shape=(3,), requires_grad=False),
    ]
    plan = plan_greedy_shards(specs, world_size=2)
    owner = {s.name: s.rank for s in plan.shards}
    files, scalars = {}, {}
    for rank in range(2):
        tensors = {}
        for spec in specs[:2]:
            if owner[spec.name] == rank:
                tensors[f"{spec.name}/exp_avg"] = [0.5] * spec.numel
                scalars[f"{spec.name}/step"] = 7
        if rank == 0:
            tensors["__model__/emb.weight"] = [1.0, 2.0, 3.0]
        data = safetensors_bytes(tensors)
        (directory / rank_file(rank, 2)).write_bytes(data)
        files[rank_file(rank, 2)] = hashlib.sha256(data).hexdigest()
    manifest = Manifest(
        framework="torch",
        optimizer="torch.optim.Adam",
        world_size=2,
        step=7,
        params=tuple(specs),
        plan=plan,
        state_keys={s.name: ("exp_avg", "step") for s in specs[:2]},
        files=files,
        extra={
            "scalars": scalars,
            "model": {"emb.weight": 0},
            **({"data": position} if position is not None else {}),
            **({"layout": layout} if layout is not None else {}),
        },
    )
    write_manifest(directory, manifest)
    return plan, owner
