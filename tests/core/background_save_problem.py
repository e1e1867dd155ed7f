"""The framework-free save of tests/core/test_background_saves.py (imported by its
subprocesses too): one rank's agreement, and a save of 4 float32 values as parameter ``w``'s
``exp_avg``."""

from __future__ import annotations

from typing import Any

from gradsync_core import CheckpointError, Manifest, ParamSpec, plan_greedy_shards
from gradsync_core.checkpoint import (
    SaveSteps,
    TensorBytes,
    rank_file,
    rank_file_metadata,
    tensor_file,
    write_rank_file,
)

SPEC = ParamSpec(name="w", shape=(4,))


class Alone:
    """The ``SaveAgreement`` of a save with one rank: nothing to agree with."""

    leader = True
    who = "rank 0"

    def all_ok(self, error: str | None, what: str) -> None:
        if error is not None:
            raise CheckpointError(f"{what}: {error}")

    def share_token(self, token: str | None) -> str:
        assert token is not None
        return token

    def gather(self, record: Any) -> list[Any]:
        return [record]


def value_save(values: bytearray, step: int, *, staged: bool) -> SaveSteps[Any]:
    """A save of ``values`` (4 float32) as parameter ``w``'s ``exp_avg``; ``staged``: copied
    at ``prepare`` (what a background save's staging does), else written from ``values``."""

    def prepare() -> Any:
        return bytes(values) if staged else values

    def write_files(data: Any, staging: str) -> dict[int, str]:
        chunks = tensor_file(
            [TensorBytes("w/exp_avg", "F32", (4,), data)], rank_file_metadata(0, 1)
        )
        return {0: write_rank_file(staging, rank_file(0, 1), chunks)}

    def manifest(data: Any, files: dict[int, str], records: list[Any]) -> Manifest:
        return Manifest(
            framework="torch",
            optimizer="torch.optim.Adam",
            world_size=1,
            step=step,
            params=(SPEC,),
            plan=plan_greedy_shards((SPEC,), world_size=1),
            state_keys={"w": ("exp_avg",)},
            files={rank_file(0, 1): files[0]},
            extra={"param_groups": [{"lr": 0.1, "params": ["w"]}], "scalars": {}},
        )

    return SaveSteps(prepare=prepare, write_files=write_files, manifest=manifest)
