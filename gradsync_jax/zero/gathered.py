"""Gathered partition: the state is sharded at rest, the update runs on the whole tree.

For optimizers whose update reads every parameter (a global norm, an all-finite test, a
learning-rate estimate from sums over all leaves: ``polyak_sgd``, Prodigy, DoG,
D-Adaptation, Mechanic, ``apply_if_finite``, ``optax.clip_by_global_norm`` anywhere in a
chain, ``noisy_sgd``'s one key split per leaf). Each device stores the state of the
parameters it owns (greedy's owners and row buffers, so the plan and the checkpoints are
greedy's), and one step is: all-reduce of the gradients, all-gather of the state rows, the
inner update on the whole tree on every device (what every device of the unsharded
data-parallel run computes, so it is exact for any optimizer that runs unsharded), and each
device keeps its own rows of the new state. It costs the full state in transient memory and
the whole optimizer arithmetic on every device, as ``jit`` with replicated compute does; the
state at rest stays the greedy share (docs/jax-zero.md, "Gathered partition").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax
from jax import lax

from gradsync_core import ShardPlan, plan_greedy_shards
from gradsync_jax._axes import cast_varying, divide_after
from gradsync_jax._naming import registration_order
from gradsync_jax.zero.layout import Collective, UpdateInputs, UpdateResult, ZeroState
from gradsync_jax.zero.model_space import ModelSpace, as_dtype
from gradsync_jax.zero.rows import OwnedRows, Rows, globals_tree, plan_rows


def _all_reduce(g: jax.Array, axes: tuple[str, ...], n: int, mean: bool) -> jax.Array:
    """The summed (``mean``: averaged) gradient on every device, divided where the flat and
    greedy partitions divide (``divide_after``), so the three partitions agree."""
    after = mean and divide_after(g.dtype, n)
    if mean and not after:
        g = g / n
    g = lax.psum(g, axes)
    return g / n if after else g


@dataclass(frozen=True, slots=True, kw_only=True)
class GatheredLayout(OwnedRows):
    """Implements ``Layout``: device ``d`` stores the state of the parameters it owns; the
    update gathers it and runs on the whole tree."""

    space: ModelSpace
    n: int
    plan: ShardPlan
    owner: tuple[int, ...]  # per parameter leaf
    state: Rows  # per-parameter state rows: keys are space indices of state leaves

    # -- inside shard_map ------------------------------------------------------------------

    def _keep_own(self, leaves: list[Any], axes: tuple[str, ...]) -> ZeroState:
        """The whole state (identical on every device) -> this device's ``ZeroState``: its
        own rows (each device packs only its own, in a ``lax.switch`` branch) and the
        globals, replicated as they are."""
        per_param = {
            k: leaf for k, leaf in enumerate(leaves) if self.space.leaves[k].param is not None
        }

        def branch(d: int) -> Any:
            def run(values: dict[int, Any]) -> Any:
                mine = {k: v for k, v in values.items() if self._owner_of(k) == d}
                return cast_varying(self.state.pack(d, mine), axes)

            return run

        rows = lax.switch(lax.axis_index(axes), [branch(d) for d in range(self.n)], per_param)
        globals_ = [as_dtype(leaves[i], self.space.leaves[i].dtype) for i in self.globals]
        shards = dict(zip(self.state.names(), [r[None] for r in rows], strict=True))
        return ZeroState(inner=globals_tree(self.space, globals_), shards=shards)

    def _owner_of(self, k: int) -> int:
        param = self.space.leaves[k].param
        assert param is not None
        return self.owner[param]

    def init_local(
        self, inner: optax.GradientTransformation, inputs: list[Any], axes: tuple[str, ...]
    ) -> ZeroState:
        """``inner.init`` of the whole (replicated) tree, so an init that reads every
        parameter (DoG's distance scale) is exact; each device keeps its rows."""
        state = inner.init(self.space.param_treedef.unflatten(inputs))
        return self._keep_own(self.space.state_treedef.flatten_up_to(state), axes)

    def update_local(
        self,
        inner: optax.GradientTransformationExtraArgs,
        inputs: UpdateInputs,
        group: Collective,
    ) -> UpdateResult:
        """All-reduce the gradients, all-gather the state rows, run ``inner`` on the whole
        tree, keep this device's rows of the new state."""
        axes = group.axes
        grads = [_all_reduce(g, axes, self.n, group.mean) for g in inputs.grads]
        gathered = [
            lax.all_gather(inputs.state.shards[name][0], axes, to="invarying")
            for name in self.state.names()
        ]
        globals_ = iter(jax.tree.leaves(inputs.state.inner))
        leaves = []
        for k, leaf in enumerate(self.space.leaves):
            if leaf.param is None:
                leaves.append(next(globals_))
            else:
                rows = [g[self.owner[leaf.param]] for g in gathered]
                leaves.append(self.state.unpack(rows, k, leaf.shape))
        treedef = self.space.param_treedef
        params = None if inputs.params is None else treedef.unflatten(inputs.params)
        # No global_norm= here: gradsync_jax.clip_by_global_norm then takes the norm of the
        # whole gradient it is given, exactly as optax's, wherever it sits in the chain.
        updates, state = inner.update(
            treedef.unflatten(grads),
            self.space.state_treedef.unflatten(leaves),
            params,
            **inputs.extra_args,
        )
        new = self._keep_own(self.space.state_treedef.flatten_up_to(state), axes)
        return UpdateResult(updates=treedef.flatten_up_to(updates), state=new)


def build_gathered(
    space: ModelSpace,
    n: int,
    *,
    order: Sequence[str] | None = None,
    modules: Mapping[str, str] | None = None,
) -> GatheredLayout:
    """Greedy owners (``plan_greedy_shards``, as ``build_greedy``, in torch registration
    ``order`` when given) and row buffers for the per-parameter state leaves of the whole
    tree, each in its owner's row."""
    specs = registration_order(space.specs, order=order, modules=modules)
    plan = plan_greedy_shards(specs, world_size=n)
    rank_of = {shard.name: shard.rank for shard in plan.shards}
    owner = tuple(rank_of[spec.name] for spec in space.specs)
    items: list[list[tuple[int, str, int]]] = [[] for _ in range(n)]
    for k, leaf in enumerate(space.leaves):
        if leaf.param is not None:
            items[owner[leaf.param]].append((k, np.dtype(leaf.dtype).name, leaf.numel))
    return GatheredLayout(space=space, n=n, plan=plan, owner=owner, state=plan_rows(items))
