"""Model weights in a gradsync checkpoint, the torch side (docs/checkpoints.md).

``ZeroRedundancyOptimizer.save(path, model=net)`` stores ``net``'s parameters beside the
optimizer state: whole tensors in torch's names and layouts, each in the file of the rank that
owns the parameter's state (``gradsync_core.model_owners``), as ``"__model__/<name>"``. A tied
parameter is stored once, under the name ``named_parameters()`` gives it, so a tied embedding
reads back into a torch module and into a Flax model that has one table (``Embed.attend``).

Loading follows ``load_state_dict(strict=True)``: every name, shape and dtype must match, and
all of them are checked before the first weight is copied, so a refused load leaves the
module as it was.
"""

from __future__ import annotations

import os
from collections.abc import Container, Mapping

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from gradsync_core import Manifest, read_manifest
from gradsync_core.checkpoint import (
    check_weight_names,
    model_key,
    rank_file,
    reading_version,
    resolve_checkpoint,
    weight_owners,
)
from gradsync_core.deprecation import renamed_keywords
from gradsync_torch._specs import dtype_name, unwrapped
from gradsync_torch.checkpoint.state_values import ValuePolicy, check_finite_weights
from gradsync_torch.param_sharding._rows import local_rows


def model_weights(
    module: nn.Module, names: Container[str] | None = None, *, to_host: bool = True
) -> dict[str, torch.Tensor]:
    """``module``'s parameters by name, each shared tensor once, detached: on the CPU, or
    where they are with ``to_host=False`` (a save that stages them copies them to the host
    once, into its pinned buffer). ``names``: only these (a rank's own weights)."""
    return {
        name: p.detach().cpu().contiguous() if to_host else p.detach()
        for name, p in module.named_parameters()
        if names is None or name in names
    }


def rank_weights(
    weights: Mapping[str, torch.Tensor], owners: Mapping[str, int], rank: int
) -> dict[str, torch.Tensor]:
    """The weights rank ``rank`` writes, by their key in its file."""
    return {model_key(name): t for name, t in weights.items() if owners[name] == rank}


def weight_files(manifest: Manifest) -> set[str]:
    """The rank files that hold model weights."""
    owners = manifest.extra.get("model", {})
    return {rank_file(rank, manifest.world_size) for rank in set(owners.values())}


def read_weights(path: str | os.PathLike[str], manifest: Manifest) -> dict[str, torch.Tensor]:
    """Every model weight of a checkpoint, by parameter name (files are not hashed here).

    Raises:
        ValueError: if the checkpoint holds no weights or a listed weight is missing.
    """
    owners = weight_owners(path, manifest)
    weights = {}
    for rank in sorted(set(owners.values())):
        file = os.path.join(path, rank_file(rank, manifest.world_size))
        try:
            handle = safe_open(file, framework="pt")
        except OSError as e:  # a removed version is named by the caller's reading_version
            raise ValueError(f"checkpoint file {file} cannot be read ({e.strerror or e})") from e
        with handle:
            stored = set(handle.keys())
            for name in sorted(n for n, r in owners.items() if r == rank):
                if model_key(name) not in stored:
                    raise ValueError(f"checkpoint file {file} lacks the weight of {name!r}")
                weights[name] = handle.get_tensor(model_key(name))
    return weights


def check_weights(
    weights: Mapping[str, torch.Tensor],
    module: nn.Module,
    *,
    allow_dtype_conversion: bool = False,
) -> None:
    """Refuse weights that ``module.load_state_dict(strict=True)`` would refuse; with
    ``allow_dtype_conversion``, a floating weight stored in another floating dtype is
    accepted (and converted by ``copy_weights``), as ``load_state_dict`` converts
    ``bfloat16`` to ``float32``.

    Raises:
        ValueError: naming the first missing, unexpected or mismatched parameter.
    """
    mine = dict(module.named_parameters())
    check_weight_names(
        weights, mine, fix="load into the model that was saved (tied parameters count once)"
    )
    for name, param in mine.items():
        saved = weights[name]
        stored = f"{tuple(saved.shape)} {dtype_name(saved.dtype)}"
        here = f"{tuple(param.shape)} {dtype_name(param.dtype)}"
        if tuple(saved.shape) != tuple(param.shape):
            raise ValueError(
                f"weight {name!r} is {stored} in the checkpoint but {here} here: another model?"
            )
        if saved.dtype == param.dtype:
            continue
        if not (saved.dtype.is_floating_point and param.dtype.is_floating_point):
            raise ValueError(
                f"weight {name!r} is {dtype_name(saved.dtype)} in the checkpoint but "
                f"{dtype_name(param.dtype)} here: a dtype mismatch that no cast makes exact"
            )
        if not allow_dtype_conversion:
            raise ValueError(
                f"weight {name!r} is {dtype_name(saved.dtype)} in the checkpoint but "
                f"{dtype_name(param.dtype)} here (same shape {tuple(param.shape)}): only the "
                "dtype differs; pass allow_dtype_conversion=True to convert it, or cast the "
                "model first"
            )


def copy_weights(module: nn.Module | None, weights: Mapping[str, torch.Tensor] | None) -> None:
    """Copy checked ``weights`` into ``module``'s parameters, in place (tied ones once; a
    parameter sharded by ``fully_shard`` takes this rank's rows of its weight); nothing when
    either is None (a load without a model, or of a checkpoint without weights)."""
    if module is None or weights is None:
        return
    with torch.no_grad():
        for name, param in module.named_parameters():
            if isinstance(param, DTensor):  # sharded by fully_shard: this rank's rows only
                param.to_local().copy_(local_rows(weights[name], param))
            else:
                param.copy_(weights[name])


@renamed_keywords(cast="allow_dtype_conversion")
def load_model_weights(
    path: str | os.PathLike[str],
    module: nn.Module,
    *,
    allow_dtype_conversion: bool = False,
    allow_nonfinite: bool = False,
) -> Manifest:
    """Load the model weights of a gradsync checkpoint into ``module`` (no process group).

    For evaluating or fine-tuning from a checkpoint written by either framework without its
    optimizer state; ``ZeroRedundancyOptimizer.load(path, model=net)`` restores both.

    Args:
        path: a checkpoint directory saved with model weights.
        module: the model; names, shapes and dtypes must match (``load_state_dict`` strict).
            A data-parallel wrapper (DDP, ``DataParallel``) loads into its ``module``.
        allow_dtype_conversion: convert weights stored in another floating dtype (a
            ``bfloat16`` checkpoint into ``float32`` parameters, or back) instead of refusing
            them.
        allow_nonfinite: take weights holding NaN or inf as they are (say, to look at a
            diverged run); by default they are refused, as ``ZeroRedundancyOptimizer.load``
            refuses them.

    Returns:
        The checkpoint's manifest.

    Raises:
        ValueError: if a file is missing or corrupt, the checkpoint holds no weights, they
            do not match ``module`` or hold NaN/inf; the module is then unchanged.

    Example:
        >>> load_model_weights("ckpt", net)  # doctest: +SKIP
        >>> bf16 = "bf16_ckpt"  # doctest: +SKIP
        >>> load_model_weights(bf16, net.float(), allow_dtype_conversion=True)  # doctest: +SKIP
    """
    module = unwrapped(module)  # a wrapper's weights are its model's: never "module." names
    path = resolve_checkpoint(path)  # one version, even while a save switches it
    with reading_version(path):  # a later save that removes it: a sentence, load again
        manifest = read_manifest(path)  # hashes every file
        weights = read_weights(path, manifest)
    check_weights(weights, module, allow_dtype_conversion=allow_dtype_conversion)
    check_finite_weights(weights, ValuePolicy(allow_nonfinite=allow_nonfinite))
    copy_weights(module, weights)
    return manifest
