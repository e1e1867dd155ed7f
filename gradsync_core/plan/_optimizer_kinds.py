"""What a sharding may do with an optimizer: the one rule both executors apply.

Sharding the optimizer state gives each rank a piece to step (docs/matrix-optimizers.md):

- ``elementwise``: the update of an element reads only that element's gradient and state
  (plus per-tensor scalars such as the step count). Any piece may be stepped alone:
  element ranges (ZeRO-2), dim-0 rows (ZeRO-3), whole tensors (ZeRO-1).
- ``per_tensor``: the update of a tensor reads the whole tensor and nothing else. Muon
  orthogonalizes each matrix (Newton-Schulz over the whole matrix), Adafactor factors the
  second moment into row and column sums. Only whole tensors may be stepped: ZeRO-1's
  owners, or, where the gradient is cut (ZeRO-2 ranges, ZeRO-3 rows), the owner path of
  ``plan_matrix_owners``: each tensor's owner gathers it, steps it and hands the pieces back.
- ``coupled``: the update reads other tensors too (L-BFGS's line search and history run over
  every parameter at once). No rank may step a part of the model alone: keep the optimizer
  replicated (data parallelism without ZeRO).

``OPTIMIZER_KINDS`` classifies canonical optimizer names; ``TORCH_OPTIMIZERS`` names torch's
classes (torch's list is fixed: its code cannot be read for the rule). JAX decides from the
jaxpr of the Optax update instead (``gradsync_jax.zero.soundness``: flat when elementwise,
greedy when per tensor, gathered when coupled); tests/parity/test_optimizer_kinds.py checks
that the analysis puts every optimizer both frameworks have in the kind listed here. An
optimizer not listed is ``unknown``: refused wherever a piece of a tensor would be stepped.
"""

from __future__ import annotations

ELEMENTWISE = "elementwise"
PER_TENSOR = "per_tensor"
COUPLED = "coupled"
UNKNOWN = "unknown"

# Canonical optimizer -> its kind.
OPTIMIZER_KINDS: dict[str, str] = {
    "sgd": ELEMENTWISE,
    "sgd_momentum": ELEMENTWISE,
    "adam": ELEMENTWISE,
    "adamw": ELEMENTWISE,
    "adamax": ELEMENTWISE,
    "nadam": ELEMENTWISE,
    "radam": ELEMENTWISE,
    "rmsprop": ELEMENTWISE,
    "adagrad": ELEMENTWISE,
    "adadelta": ELEMENTWISE,
    "rprop": ELEMENTWISE,
    "asgd": ELEMENTWISE,
    "lion": ELEMENTWISE,
    "muon": PER_TENSOR,
    "adafactor": PER_TENSOR,
    "lbfgs": COUPLED,
}

# A per-tensor optimizer -> the cost its owners are balanced by (``MATRIX_COSTS``).
OWNER_COSTS: dict[str, str] = {"muon": "newton_schulz", "adafactor": "numel"}

# torch's optimizer classes (as ``module.qualname`` names them publicly) -> canonical names.
# ``torch.optim.SparseAdam`` is left out: it steps only sparse gradients, which no gradsync
# reduction makes, so it is ``unknown`` (torch refuses the dense ones itself).
TORCH_OPTIMIZERS: dict[str, str] = {
    "torch.optim.SGD": "sgd",
    "torch.optim.Adam": "adam",
    "torch.optim.AdamW": "adamw",
    "torch.optim.Adamax": "adamax",
    "torch.optim.NAdam": "nadam",
    "torch.optim.RAdam": "radam",
    "torch.optim.RMSprop": "rmsprop",
    "torch.optim.Adagrad": "adagrad",
    "torch.optim.Adadelta": "adadelta",
    "torch.optim.Rprop": "rprop",
    "torch.optim.ASGD": "asgd",
    "torch.optim.Muon": "muon",
    "torch.optim.Adafactor": "adafactor",
    "torch.optim.LBFGS": "lbfgs",
}


def optimizer_kind(name: str) -> str:
    """The kind of canonical optimizer ``name`` or torch class name ``torch.optim.X``:
    ``elementwise``, ``per_tensor``, ``coupled`` or ``unknown``.

    Example:
        >>> optimizer_kind("torch.optim.Muon"), optimizer_kind("adamw")
        ('per_tensor', 'elementwise')
        >>> optimizer_kind("my.Optimizer")
        'unknown'
    """
    return OPTIMIZER_KINDS.get(TORCH_OPTIMIZERS.get(name, name), UNKNOWN)


def owner_cost(name: str) -> str:
    """The cost the owners of per-tensor optimizer ``name`` are balanced by
    (``newton_schulz`` for Muon; ``numel`` otherwise)."""
    return OWNER_COSTS.get(TORCH_OPTIMIZERS.get(name, name), "numel")


def optimizers_of_kind(kind: str, *, torch: bool = False) -> list[str]:
    """The optimizers of ``kind``, sorted: canonical names, or torch's class names
    (``SGD``, ``Adam``, ...) with ``torch=True``, as the refusals list them."""
    if torch:
        return sorted(
            name.rpartition(".")[2]
            for name, canonical in TORCH_OPTIMIZERS.items()
            if OPTIMIZER_KINDS[canonical] == kind
        )
    return sorted(name for name, k in OPTIMIZER_KINDS.items() if k == kind)
