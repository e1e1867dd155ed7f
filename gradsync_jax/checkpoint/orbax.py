"""A gradsync checkpoint to Orbax and back (docs/interchange.md).

Orbax stores a pytree, so the tree comes from the program: ``export_orbax`` reads a
gradsync checkpoint (written by either framework, at any world size) into the parameter tree
and plain Optax state the caller's templates describe (``load_params``,
``load_optimizer_state``: every check theirs) and saves ``{"params": weights, "opt_state":
state}`` with ``orbax.checkpoint.StandardCheckpointer``; a Flax/Optax program restores it with
the same templates. ``import_orbax`` restores such a tree and writes it with
``save_optimizer_state`` over a one-device mesh: a gradsync checkpoint either framework loads
at any world size.

Both run in one JAX process (a conversion, not a training step): the import's mesh is that
process's first device.

``orbax-checkpoint`` is an optional dependency (``pip install "gradsync[orbax]"``), imported
only when these functions run.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax

from gradsync_core import Topology
from gradsync_core.deprecation import renamed_keywords
from gradsync_jax._mesh import mesh_from_topology
from gradsync_jax.checkpoint.model_state import load_params
from gradsync_jax.checkpoint.zero import load_optimizer_state, save_optimizer_state
from gradsync_jax.zero import shard_optimizer


def _checkpointer() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise ImportError(
            "Orbax interchange needs orbax-checkpoint, which is not installed; "
            'pip install "gradsync[orbax]"'
        ) from None
    return ocp.StandardCheckpointer()


@renamed_keywords(optimizer="tx")
def export_orbax(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    params: Any,
    tx: optax.GradientTransformation,
    model: Any = None,
    modules: Mapping[str, str] | None = None,
) -> None:
    """Write the gradsync checkpoint ``src`` as an Orbax checkpoint ``dst`` of
    ``{"params": weights, "opt_state": Optax state}``.

    Args:
        src: a gradsync checkpoint saved with model weights, by torch or JAX.
        dst: the Orbax checkpoint directory (must not exist).
        params: the tree ``tx`` trains (arrays or ``jax.ShapeDtypeStruct``).
        tx: the plain Optax transformation (``optax.adamw(...)``), the counterpart of the
            saved optimizer.
        model: the weights tree to store as ``"params"`` when it holds more than ``params``
            (frozen parameters kept out of the optimizer); default ``params``.
        modules: the Flax-to-torch module renames (see ``torch_name``).

    Restore with ``orbax.checkpoint.StandardCheckpointer().restore(dst, {"params": model,
    "opt_state": tx.init(params)})`` (docs/interchange.md).

    Raises:
        ValueError: one sentence if ``src`` does not match the templates.
        ImportError: if orbax-checkpoint is not installed.
    """
    checkpointer = _checkpointer()
    weights = load_params(src, params if model is None else model, modules=modules)
    opt_state, _ = load_optimizer_state(src, tx, params, modules=modules)
    tree = {"params": weights, "opt_state": opt_state}
    checkpointer.save(os.path.abspath(dst), tree)
    checkpointer.wait_until_finished()


@renamed_keywords(optimizer="tx")
def import_orbax(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    params: Any,
    tx: optax.GradientTransformation,
    model: Any = None,
    modules: Mapping[str, str] | None = None,
) -> None:
    """Write the Orbax checkpoint ``src`` (``{"params": weights, "opt_state": Optax state}``,
    as ``export_orbax`` writes it) as a gradsync checkpoint ``dst`` with model weights,
    which ``load_optimizer_state`` (any mesh) and torch's ``ZeroRedundancyOptimizer.load``
    (any world size) read; arguments as for ``export_orbax``. The manifest's step is the
    Optax ``count``.

    Raises:
        ValueError: one sentence if ``src`` does not hold the templates' tree.
        ImportError: if orbax-checkpoint is not installed.
    """
    checkpointer = _checkpointer()
    weights_like = params if model is None else model
    target = jax.eval_shape(lambda: {"params": weights_like, "opt_state": tx.init(params)})
    try:
        restored = checkpointer.restore(os.path.abspath(src), target)
    except (ValueError, KeyError, FileNotFoundError) as err:
        raise ValueError(
            f"cannot restore Orbax checkpoint {os.fspath(src)!r} into these templates "
            f"({_reason(err)}); pass the params, tx and model it was saved from"
        ) from None
    mesh = mesh_from_topology(Topology.create(1), jax.devices()[:1])
    sharded = shard_optimizer(tx, mesh, partition="greedy", modules=modules)
    state = sharded.scatter_state(restored["opt_state"], params)
    save_optimizer_state(
        dst,
        sharded,
        state,
        params,
        step=_count(restored["opt_state"]),
        modules=modules,
        model=restored["params"],
    )


def _reason(err: Exception) -> str:
    """Orbax's reason in a few words: a tree mismatch names its first differing path."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [repr(err)]
    if "do not match" in lines[0] and len(lines) > 1:
        return f"the saved tree and the templates differ at {lines[1].rstrip(':')}"
    return lines[0]


def _count(opt_state: Any) -> int:
    """The Optax step count of ``opt_state`` (its ``count`` leaves), 0 if it keeps none."""
    leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    counts = [
        int(np.asarray(leaf))
        for path, leaf in leaves
        if path and getattr(path[-1], "name", None) == "count"
    ]
    return max(counts, default=0)
