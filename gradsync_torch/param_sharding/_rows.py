"""A sharded parameter's rows, from outside the hooks: what checkpoints read and write.

``fully_shard`` leaves every parameter an ``nn.Parameter`` holding a ``DTensor`` with
``Shard(0)`` on a 1-D mesh, or ``(Replicate(), Shard(0))`` on a 2-D one (HSDP), its local
tensor the rank's unpadded rows of the shard dimension (``_unit.py``), exactly FSDP2's
representation, and torch's optimizers keep their state in the same form. These helpers go
between that form and model space (whole tensors) by the plan's one cut rule,
``gradsync_core.chunk_rows``, so a checkpoint never needs the hooks' internals.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard

from gradsync_core import chunk_rows


def check_row_sharded(name: str, value: torch.Tensor) -> DTensor:
    """``value`` as a row-sharded ``DTensor`` (``Shard(0)`` on a 1-D mesh, or
    ``(Replicate(), Shard(0))`` on a 2-D one: HSDP), or a sentence.

    Raises:
        ValueError: naming ``name`` if it is another tensor (not sharded by ``fully_shard``,
            or sharded another way).
    """
    if not isinstance(value, DTensor):
        raise ValueError(
            f"{name} is a plain {type(value).__name__}, not a DTensor: every parameter of the "
            "model must be sharded by gradsync_torch.fully_shard (call it on the root too)"
        )
    if tuple(value.placements) not in ((Shard(0),), (Replicate(), Shard(0))):
        raise ValueError(
            f"{name} is placed {tuple(value.placements)} on a {value.device_mesh.ndim}-D mesh; "
            "a ZeRO-3 checkpoint holds parameters sharded by fully_shard (Shard(0) on a 1-D "
            "mesh, or (Replicate(), Shard(0)) on a 2-D one)"
        )
    return value


def shard_mesh(named: Iterable[tuple[str, torch.Tensor]]) -> DeviceMesh:
    """The one mesh every parameter in ``named`` is row-sharded over.

    Raises:
        ValueError: a parameter not row-sharded, two meshes, or no parameter at all.
    """
    mesh = None
    for name, param in named:
        this = check_row_sharded(f"parameter {name!r}", param).device_mesh
        if mesh is None:
            mesh, first = this, name
        elif this != mesh:
            raise ValueError(
                f"parameters {first!r} and {name!r} are sharded over different meshes; a "
                "ZeRO-3 checkpoint is written by one data-parallel mesh"
            )
    if mesh is None:
        raise ValueError("the model has no parameters to checkpoint")
    return mesh


def shard_dim(mesh: DeviceMesh) -> int:
    """The mesh dimension the rows are cut over: the only one, or (HSDP) the last."""
    return mesh.ndim - 1


def held_rows(like: DTensor) -> tuple[int, int]:
    """The rows ``[start, stop)`` of dim 0 that this rank holds of ``like``."""
    mesh, dim = like.device_mesh, shard_dim(like.device_mesh)
    start, stop, _ = chunk_rows(like.shape[0], mesh.size(dim), mesh.get_local_rank(dim))
    return start, stop


def held_elements(like: DTensor) -> tuple[int, int]:
    """``held_rows`` as elements of the flattened tensor (a checkpoint's slice)."""
    start, stop = held_rows(like)
    row = like.numel() // like.shape[0] if like.shape[0] else 0
    return start * row, stop * row


def local_rows(whole: torch.Tensor, like: DTensor) -> torch.Tensor:
    """The rows of model-space ``whole`` that this rank holds of ``like`` (its local shape)."""
    start, stop = held_rows(like)
    return whole[start:stop]


def as_row_sharded(local: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's rows ``local`` as a ``DTensor`` of ``like``'s spec, on ``like``'s device
    (the form torch's optimizers keep for a sharded parameter's state)."""
    return DTensor.from_local(
        local.to(like.device).contiguous(),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )
