"""A gradsync checkpoint to torch Distributed Checkpoint (DCP) and back (docs/interchange.md).

DCP stores state dicts, not a model: ``export_dcp`` loads a gradsync checkpoint into the
user's model and plain optimizer (``load_model_weights``, ``load_optimizer_state_dict``, every
check theirs), takes ``get_state_dict(model, optimizer)`` (fully qualified names, a tied
weight under each of its names, as DCP users load it) and saves ``{"model": ..., "optim":
...}`` with ``dcp.save``. ``import_dcp`` does the reverse and writes a one-rank gradsync
checkpoint that either framework loads at any world size.

Layout: DCP's default ``FileSystemWriter`` (``.distcp`` files and ``.metadata``). torch 2.13's
``HuggingFaceStorageWriter`` (safetensors, no pickle) is made for tensors: it saves an
optimizer state dict's ``param_groups`` (floats, tuples), but its reader cannot read the file
back ("header too large", or a ``KeyError``) and a plain ``dcp.load`` finds no ``.metadata``,
so it cannot hold what ``torch.optim.AdamW`` restores.

A fresh optimizer has no state, and ``dcp.load`` fills only the keys of the state dict it is
given, so loading into ``optimizer.state_dict()`` silently leaves the moments out.
``get_state_dict`` creates the state first; ``import_dcp`` and the documented recipe use it,
and ``import_dcp`` reads only the tensors (never unpickles ``param_groups``: the
hyper-parameters are the given optimizer's). DCP's own reader unpickles ``.metadata``, which a
downloaded checkpoint could make run code; ``import_dcp`` reads it through ``dcp_reader``'s
restricted unpickler instead.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from gradsync_torch._specs import unwrapped
from gradsync_torch.checkpoint.model_state import load_model_weights
from gradsync_torch.checkpoint.plain import load_optimizer_state_dict
from gradsync_torch.checkpoint.plain_save import save_plain

# Optimizers whose lazily created state is zeros and a 0-d ``step`` of 0 (their ``_init_group``):
# state a checkpoint saved before the first step can be written as, exactly.
_ZERO_INIT = (torch.optim.Adam, torch.optim.AdamW)


def _fresh_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every trainable parameter without state the state its first ``step`` would
    create, so DCP holds (and a load restores) every key; refuse an optimizer whose first
    state is not zeros, instead of writing what its step would not have made."""
    missing = [
        (p, group)
        for group in optimizer.param_groups
        for p in group["params"]
        if p.requires_grad and not optimizer.state.get(p)
    ]
    if not missing:
        return
    if not isinstance(optimizer, _ZERO_INIT):
        raise ValueError(
            f"the checkpoint holds no {type(optimizer).__name__} state for a parameter of shape "
            f"{tuple(missing[0][0].shape)} (saved before its first step) and DCP cannot record "
            "absent state; export a checkpoint saved after a step"
        )
    # torch's ``_get_scalar_dtype``: the step is float64 only under a float64 default dtype.
    step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for p, group in missing:
        state = {"step": torch.tensor(0.0, dtype=step_dtype)}
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad") else [])
        for key in keys:
            state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        optimizer.state[p] = state


def export_dcp(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> None:
    """Write the gradsync checkpoint ``src`` as a DCP checkpoint ``dst`` of
    ``{"model": model state dict, "optim": optimizer state dict}`` (one process).

    ``model`` and ``optimizer`` say what the checkpoint is (names, a tied weight's other
    name, the optimizer class); they are overwritten with ``src``'s weights and state.
    Parameters ``src`` holds no state for yet get the state a first ``step`` creates (Adam,
    AdamW: zeros, ``step`` 0), so a later ``dcp.load`` restores every key.

    Restore it with plain DCP (docs/interchange.md)::

        state = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
        dcp.load(state, checkpoint_id=dst)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    Raises:
        ValueError: one sentence, if ``src`` does not match ``model`` and ``optimizer`` (every
            check of ``load_model_weights`` and ``load_optimizer_state_dict``), holds no
            weights, or holds no state for an optimizer other than Adam or AdamW.

    Example:
        >>> export_dcp("ckpt", "ckpt_dcp", net, opt)  # doctest: +SKIP
    """
    import torch.distributed.checkpoint as dcp  # here: it would slow ``import gradsync_torch``
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = unwrapped(model)
    load_model_weights(src, model)
    load_optimizer_state_dict(src, optimizer, model)
    _fresh_state(optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.fspath(dst), no_dist=True)


def import_dcp(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> None:
    """Write the DCP checkpoint ``src`` (``{"model": ..., "optim": ...}`` as ``export_dcp`` or
    ``dcp.save(get_state_dict(...))`` wrote it) as a one-rank gradsync checkpoint ``dst``
    with model weights, which ``ZeroRedundancyOptimizer.load`` (any world size) and
    ``gradsync_jax.load_optimizer_state`` / ``load_params`` read.

    ``model`` and ``optimizer`` receive ``src``'s weights and state (through
    ``get_state_dict``, which creates a fresh optimizer's state so no moment is left out).
    Only tensors are read: the hyper-parameters stored are ``optimizer``'s own, since DCP
    keeps ``param_groups`` pickled and gradsync never unpickles.

    Raises:
        ValueError: one sentence, if ``src`` lacks a tensor the model or optimizer has, or
            its ``.metadata`` names anything but DCP's metadata classes, or it stores a
            tensor this reads as pickled bytes (nothing of it is run: ``dcp_reader``).

    Example:
        >>> import_dcp("ckpt_dcp", "ckpt", net, opt)  # doctest: +SKIP
    """
    import torch.distributed.checkpoint as dcp  # here: it would slow ``import gradsync_torch``
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from gradsync_torch.checkpoint.dcp_reader import TensorReader, read_dcp_metadata

    model = unwrapped(model)
    _check_no_gradients(optimizer)
    # Before anything else: DCP's own reader unpickles .metadata, which can run code.
    reader = TensorReader(src, read_dcp_metadata(src))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    tensors = {"model": model_sd, "optim": {"state": optim_sd["state"]}}
    try:
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as err:  # the latter is a BaseException
        # DCP's text is every rank's traceback; its last line is the reason.
        first = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"cannot read DCP checkpoint {os.fspath(src)!r} into this model and optimizer "
            f"({first}); import reads {{'model', 'optim'}} as get_state_dict(model, optimizer) "
            "gives them (parameter names, not optimizer.state_dict()'s indices), as export_dcp "
            "writes them: pass the model and optimizer it was saved from"
        ) from err
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    save_plain(dst, model, optimizer)


def _check_no_gradients(optimizer: torch.optim.Optimizer) -> None:
    """``get_state_dict`` creates a stateless optimizer's state only when no parameter has a
    gradient; otherwise ``dcp.load`` would silently load no moments."""
    if optimizer.state:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                raise ValueError(
                    f"the optimizer has no state yet and a parameter of shape {tuple(p.shape)} "
                    "has a gradient, so DCP would load no optimizer state into it; call "
                    "optimizer.zero_grad(set_to_none=True) before importing"
                )
