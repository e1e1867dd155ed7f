"""Which state keys a checkpoint must hold for the torch optimizer loading it (docs/checkpoints.md).

A manifest whose parameter lacks a key its optimizer keeps (``exp_avg_sq`` dropped by hand or
by a bad converter) would load and then fail inside ``optimizer.step``: a ``KeyError`` on
the rank that owns the parameter while the others wait in a collective. The keys are checked
against what the optimizer keeps before anything is loaded, on every rank:

- from JAX: the canonical keys of the torch/Optax pair (``gradsync_core.COUNTERPARTS``);
- from torch: the keys a throw-away instance of the optimizer class creates when it steps a
  one-element tensor with the saved hyper-parameters of the parameter's group (Adam's
  ``amsgrad`` adds ``max_exp_avg_sq``, SGD keeps ``momentum_buffer`` only with momentum).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from gradsync_core import Manifest
from gradsync_core.checkpoint import check_state_keys, counterpart_keys
from gradsync_torch._optim_state import NOT_HYPER
from gradsync_torch.checkpoint.json_values import from_json


def probe_state_keys(
    optimizer_class: type[torch.optim.Optimizer], hyper: Mapping[str, Any]
) -> tuple[str, ...] | None:
    """The keys ``optimizer_class`` keeps per parameter after a step with ``hyper``, or
    ``None`` when it cannot step a lone CPU tensor (it needs a closure, a GPU, ...)."""
    probe = torch.zeros(1, requires_grad=True)
    probe.grad = torch.ones(1)
    try:
        make: Callable[..., torch.optim.Optimizer] = optimizer_class  # a subclass's signature
        optimizer = make([{"params": [probe], **hyper}])
        optimizer.step()
    except Exception:  # the check is then left to the optimizer's own step
        return None
    return tuple(sorted(k for k, v in optimizer.state[probe].items() if v is not None))


def check_torch_keys(
    manifest: Manifest,
    optimizer: str,
    optimizer_class: type[torch.optim.Optimizer],
    param_groups: Sequence[Mapping[str, Any]],
) -> None:
    """Refuse a torch checkpoint that lacks (or adds) a state key of a parameter's group;
    call once the param groups are known to hold the same parameters.

    Parameters without state yet (never stepped) are accepted, as the optimizer accepts them.

    Raises:
        ValueError: naming the optimizer, the parameter and the key.
    """
    saved_groups = manifest.extra.get("param_groups", [])
    for group, saved in zip(param_groups, saved_groups, strict=True):  # checked equal
        hyper = {k: from_json(v, group.get(k)) for k, v in saved.items() if k not in NOT_HYPER}
        stepped = [n for n in saved.get("params", []) if manifest.state_keys.get(n)]
        if not stepped:
            continue
        needed = probe_state_keys(optimizer_class, hyper)
        if needed is None:
            continue
        for name in stepped:
            check_state_keys(manifest.optimizer, optimizer, name, manifest.state_keys[name], needed)


def check_other_framework_keys(path: str, manifest: Manifest, optimizer: str) -> None:
    """Refuse a JAX-written checkpoint this optimizer cannot continue from exactly."""
    if manifest.version < 2:
        raise ValueError(
            f"{path} was written by gradsync_jax in format version 1 (Flax names and layouts), "
            "which only gradsync_jax reads; load it there with load_optimizer_state and save "
            "it again to get version 2, which torch reads"
        )
    global_keys = manifest.extra.get("global_keys", [])
    if global_keys:
        raise ValueError(
            f"{path} holds Optax state with no torch counterpart ({global_keys[0]!r}, e.g. an "
            "injected hyper-parameter); save it from an Optax optimizer without it"
        )
    needed = counterpart_keys(optimizer, manifest.optimizer) or ()
    for name, keys in manifest.state_keys.items():
        if keys:
            check_state_keys(manifest.optimizer, optimizer, name, keys, needed)
