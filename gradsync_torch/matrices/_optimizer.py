"""``MatrixOptimizer``: a per-tensor optimizer (Muon) stepped exactly under any sharding.

``torch.optim.Muon`` orthogonalizes each matrix's momentum over the whole matrix, so a rank
holding part of a matrix (``fully_shard``'s rows, ZeRO-2's element ranges) cannot step it
alone. Wrapped in ``MatrixOptimizer``, every matrix gets one owner from
``gradsync_core.plan_matrix_owners`` (balanced by Newton-Schulz work); the owner receives the
matrix's whole gradient, runs the wrapped optimizer's own ``step`` on it (the same torch
code, so the same bits as one process given the same gradient) and hands every rank back its
part (``_layouts.py``). The momentum lives whole on the owner. Elementwise parameters (biases,
norms, embeddings: Muon's users give them to AdamW) stay with their own optimizer on the
sharded elementwise path. See docs/matrix-optimizers.md.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from gradsync_core import (
    MatrixOwnerPlan,
    OwnerExchange,
    ParamSpec,
    SaveHandle,
    plan_matrix_owners,
)
from gradsync_core.plan import ELEMENTWISE, PER_TENSOR, owner_cost
from gradsync_torch._optim_rules import StepsWholeTensors, kind_of, qualified_name
from gradsync_torch._optim_state import (
    OwnsShardedState,
    RankGroup,
    StatePiece,
    assemble,
    check_same_param_groups,
    hyper_parameters,
    optimizer_name,
    param_specs_of,
    parameter_names,
)
from gradsync_torch.agreement import Disagreement, agree_on
from gradsync_torch.checkpoint import zero as checkpoint
from gradsync_torch.checkpoint.model_state import copy_weights
from gradsync_torch.matrices._layouts import Matrix, ReplicatedLayout, RowsLayout
from gradsync_torch.param_sharding._unit import ROWS
from gradsync_torch.zero.state import consolidate, copy_hyper, to_cpu


def _describe(d: Disagreement) -> str:
    return (
        f"MatrixOptimizer: the matrix-owner plan differs across ranks (ranks {d.agreeing} "
        f"agree with rank {d.base_rank}, ranks {d.differing} do not); build the same "
        "optimizer over the same parameters on every rank"
    )


class MatrixOptimizer(Optimizer, OwnsShardedState, StepsWholeTensors):
    """Step a per-tensor optimizer (``torch.optim.Muon``, ``torch.optim.Adafactor``) exactly
    on parameters sharded by ``fully_shard`` (ZeRO-3) or replicated (ZeRO-1, ZeRO-2).

    Build the optimizer as for one process, over the matrices only, and wrap it; give the
    other parameters to an elementwise optimizer (``torch.optim.AdamW`` on ``fully_shard``'s
    rows, or ``ZeroRedundancyOptimizer``). Call ``step`` and ``zero_grad`` on the wrapper
    (never on the wrapped optimizer), on every rank: it is a collective. Learning-rate
    schedulers attach to the wrapper.

    The parameters decide the layout: row-sharded ``DTensor``s from ``fully_shard`` (1-D
    mesh): each owner receives the rows of its matrices' gradients and parameters from every
    rank (one all-to-all) and sends back the updated rows (another). Whole tensors: the
    gradients are already averaged (``DataParallel``, DDP: ZeRO-1), or, with
    ``shard_gradients=True`` (ZeRO-2), local, and ``step`` reduces each matrix's gradient to
    its owner only; the owner steps the matrix and broadcasts it.

    Args:
        optimizer: the per-tensor optimizer, built over the matrices (``named_parameters``
            give the plan and the checkpoints their names).
        process_group: whole tensors: the data-parallel group (default: the world). Row
            shards bring their own (the ``fully_shard`` mesh).
        shard_gradients: whole tensors only: the gradients are local, not averaged (ZeRO-2).
        model: where to look the parameters' names up, if ``optimizer`` has none.

    Raises:
        ValueError: an elementwise-only, coupled or unknown optimizer class (the sentence
            says what to use), a mix of row shards and whole tensors, an HSDP mesh,
            ``shard_gradients`` with row shards, or a plan that differs across ranks.

    Example:
        >>> matrices = [(n, p) for n, p in model.named_parameters() if p.ndim == 2]
        >>> muon = MatrixOptimizer(torch.optim.Muon(matrices, lr=0.02))  # doctest: +SKIP
        >>> loss.backward(); muon.step(); adamw.step()  # doctest: +SKIP
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        process_group: Any | None = None,
        shard_gradients: bool = False,
        model: nn.Module | None = None,
    ) -> None:
        if not isinstance(optimizer, Optimizer) or isinstance(optimizer, MatrixOptimizer):
            raise TypeError(
                "MatrixOptimizer wraps a torch optimizer instance, e.g. "
                f"MatrixOptimizer(torch.optim.Muon(matrices, lr=0.02)); got {optimizer!r}"
            )
        cls = type(optimizer)
        kind = kind_of(cls)
        if kind not in (PER_TENSOR, ELEMENTWISE):
            raise ValueError(
                f"MatrixOptimizer steps each tensor whole on one rank, which is exact for "
                f"optimizers whose update of a tensor reads only that tensor (torch.optim's "
                f"Muon, Adafactor and the elementwise ones); {qualified_name(cls)} is "
                + (
                    "coupled (it reads every parameter at once): keep it replicated, with "
                    "DataParallel and no ZeRO"
                    if kind == "coupled"
                    else "not one gradsync can tell apart: use torch.optim.Muon or Adafactor"
                )
            )
        if not dist.is_initialized():
            raise RuntimeError(
                "MatrixOptimizer needs torch.distributed; call "
                "torch.distributed.init_process_group() first (world_size=1 works too)"
            )
        self.inner_class = cls
        # The constructor's own arguments among the defaults (AdamW's defaults also hold
        # decoupled_weight_decay, which its constructor does not take).
        accepted = inspect.signature(cls.__init__).parameters
        self._local_defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        groups = [dict(group) for group in optimizer.param_groups]
        super().__init__(groups, optimizer.defaults)
        params = [p for group in self.param_groups for p in group["params"]]
        rows = [getattr(p, ROWS, None) is not None for p in params]
        self.sharded = any(rows)
        if self.sharded and not all(rows):
            raise ValueError(
                "MatrixOptimizer's parameters are partly row shards of fully_shard and partly "
                "whole tensors; shard the whole model with fully_shard, or none of it"
            )
        if self.sharded:
            group, rank, world_size = self._shard_group(params, process_group, shard_gradients)
        else:
            group, rank = process_group, dist.get_rank(process_group)
            world_size = dist.get_world_size(process_group)
        self.process_group = group
        self._ranks = RankGroup(group, rank, world_size)
        self.rank, self.world_size = rank, world_size
        self.shard_gradients = shard_gradients
        self._model = model
        names = self._names()
        self.specs = self._specs_of(names, params)
        self.owner_plan: MatrixOwnerPlan = plan_matrix_owners(
            self.specs, world_size=world_size, cost=owner_cost(optimizer_name(cls))
        )
        if world_size > 1:
            agree_on(self.owner_plan.to_json(), group, describe=_describe)
        self.matrices = self._matrices(names, params)
        self.local = self._local_optimizer()
        self.layout: RowsLayout | ReplicatedLayout
        if self.sharded:
            self.layout = RowsLayout(self.matrices, group, rank, world_size)
        else:
            self.layout = ReplicatedLayout(
                self.matrices, group, rank, world_size, shard_gradients=shard_gradients
            )
        self._steps = 0
        self._consolidated: dict[int, dict[str, Any]] | None = None

    # -- construction ------------------------------------------------------------------------

    @staticmethod
    def _shard_group(
        params: list[torch.Tensor], process_group: Any, shard_gradients: bool
    ) -> tuple[Any, int, int]:
        mesh = params[0].device_mesh  # type: ignore[attr-defined]
        if any(p.device_mesh != mesh for p in params):  # type: ignore[attr-defined]
            raise ValueError(
                "MatrixOptimizer's parameters are sharded over different meshes; wrap one "
                "optimizer per fully_shard mesh"
            )
        if mesh.ndim != 1:
            raise ValueError(
                "MatrixOptimizer steps row shards of a 1-D fully_shard mesh; hybrid sharding "
                "(HSDP, a 2-D mesh) is not supported yet: use a 1-D mesh for the matrices"
            )
        if process_group is not None or shard_gradients:
            raise ValueError(
                "fully_shard's row shards bring their process group and their reduced "
                "gradients: leave process_group and shard_gradients out for them"
            )
        return mesh.get_group(), mesh.get_local_rank(), mesh.size()

    def _names(self, model: nn.Module | None = None) -> list[str]:
        try:
            return parameter_names(self.param_groups, model or self._model)
        except ValueError:
            count = sum(len(g["params"]) for g in self.param_groups)
            return [f"param[{i}]" for i in range(count)]

    def _specs_of(self, names: list[str], params: list[torch.Tensor]) -> list[ParamSpec]:
        # A frozen matrix keeps its owner: it may be unfrozen later.
        return [replace(s, requires_grad=True) for s in param_specs_of(names, params, set())]

    def _matrices(self, names: list[str], params: list[torch.Tensor]) -> list[Matrix]:
        group_of = [g for g, group in enumerate(self.param_groups) for _ in group["params"]]
        owners = {m.name: m.owner for m in self.owner_plan.matrices}
        out = []
        for i, (name, param) in enumerate(zip(names, params, strict=True)):
            owner = owners[name]
            whole = None
            if owner == self.rank:
                if self.sharded:
                    whole = torch.empty(param.shape, dtype=param.dtype, device=param.device)
                else:
                    whole = param
            out.append(
                Matrix(
                    index=i,
                    name=name,
                    param=param,
                    shape=tuple(param.shape),
                    owner=owner,
                    group=group_of[i],
                    whole=whole,
                )
            )
        return out

    def _local_optimizer(self) -> Optimizer:
        """The wrapped class over the whole matrices this rank owns, group by group."""
        groups = [{**hyper_parameters(g), "params": []} for g in self.param_groups]
        for m in self.matrices:
            if m.whole is not None:
                groups[m.group]["params"].append(m.whole)
        return self.inner_class(groups, **self._local_defaults)

    # -- torch.optim.Optimizer API ------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only at construction: the owners are planned once for all matrices.

        Raises:
            ValueError: after construction.
        """
        if getattr(self, "local", None) is not None:
            raise ValueError(
                "MatrixOptimizer plans its owners once; build the wrapped optimizer with all "
                "its param groups before wrapping it"
            )
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the parameters and of the owner's whole matrices."""
        super().zero_grad(set_to_none)
        self.local.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Gather each matrix to its owner, step it there, hand the parts back (a collective).

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The loss returned by ``closure``, if any.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        copy_hyper(self.param_groups, self.local.param_groups)
        self.layout.gather()
        self.local.step()
        self.layout.scatter()
        copy_hyper(self.local.param_groups, self.param_groups)
        self._steps += 1
        return loss

    @property
    def exchanged(self) -> OwnerExchange:
        """The elements this rank sent and received in the last step's exchange (the
        gradient reductions of ZeRO-2 and the broadcasts of whole tensors included)."""
        return self.layout.exchanged

    @property
    def steps(self) -> int:
        """Steps taken (restored by ``load``)."""
        return self._steps

    # -- state in model space ----------------------------------------------------------------

    def _pieces(self) -> list[StatePiece]:
        out = []
        for m in self.matrices:
            state = None if m.whole is None else self.local.state.get(m.whole)
            if state:
                out.append(StatePiece(m.index, 0, m.numel, True, state))
        return out

    def _shapes(self) -> list[tuple[int, ...]]:
        return [m.shape for m in self.matrices]

    def full_state(self) -> dict[str, dict[str, Any]]:
        """Every matrix's state in model space (whole tensors) by name, on every rank (a
        collective: the owners' states are all-gathered; for tests and inspection)."""
        gathered: list[Any] = [to_cpu(self._pieces())]
        if self.world_size > 1:
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, to_cpu(self._pieces()), group=self.process_group)
        pieces = [StatePiece(*piece) for rank_pieces in gathered for piece in rank_pieces]
        full = assemble(pieces, self._shapes())
        return {m.name: full[m.index] for m in self.matrices if m.index in full}

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full state on group rank ``to`` (a collective), for ``state_dict()``."""
        copy_hyper(self.param_groups, self.local.param_groups)
        self._consolidated = consolidate(self._pieces(), self._shapes(), self._ranks, to)

    def state_dict(self) -> dict[str, Any]:
        """The full state in torch's format (global indices, whole tensors), loadable by the
        wrapped optimizer in one process; only on the rank of the last
        ``consolidate_state_dict``.

        Raises:
            RuntimeError: if this rank holds no consolidated state.
        """
        if self._consolidated is None:
            raise RuntimeError(
                "MatrixOptimizer keeps each matrix's state on its owner: call "
                f"consolidate_state_dict(to={self.rank}) on all ranks first"
            )
        state_dict = super().state_dict()
        state_dict["state"] = dict(sorted(self._consolidated.items()))
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a torch-format state dict of the same parameters (whole tensors); each owner
        keeps its matrices' state.

        Raises:
            ValueError: if its param groups do not match this optimizer's.
        """
        groups = state_dict["param_groups"]
        check_same_param_groups(groups, self.param_groups)
        full = {int(k): v for k, v in state_dict["state"].items()}
        self._set_state(full, groups)

    def _set_state(self, full: dict[int, dict[str, Any]], groups: list[dict[str, Any]]) -> None:
        copy_hyper(groups, self.param_groups)
        copy_hyper(self.param_groups, self.local.param_groups)
        for m in self.matrices:
            if m.whole is None:
                continue
            self.local.state.pop(m.whole, None)
            if m.index in full:
                self.local.state[m.whole] = {
                    k: v.detach().to(m.whole.device).clone() if torch.is_tensor(v) else v
                    for k, v in full[m.index].items()
                }

    # -- checkpoints -------------------------------------------------------------------------

    @overload
    def save(
        self,
        path: str | os.PathLike[str],
        *,
        model: nn.Module | None = None,
        blocking: Literal[True] = True,
    ) -> None: ...

    @overload
    def save(
        self,
        path: str | os.PathLike[str],
        *,
        model: nn.Module | None = None,
        blocking: Literal[False],
    ) -> SaveHandle: ...

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        model: nn.Module | None = None,
        blocking: bool = True,
    ) -> SaveHandle | None:
        """Write the state in gradsync's checkpoint format (model space; a collective): a
        load at any world size, or by ``ZeroRedundancyOptimizer`` and plain torch of the
        same optimizer class, reads it. With ``model`` (whole tensors only) the weights are
        stored too; a ``fully_shard``-ed model's are saved with ``save_param_shards``.

        With ``blocking=False`` the call returns once this rank's matrices' state (and the
        weights it stores) are copied to host staging memory; the files are written in the
        background, as ``ZeroRedundancyOptimizer.save`` says.

        Returns:
            ``None``; with ``blocking=False`` a ``SaveHandle`` whose ``wait()`` returns the
            manifest.

        Raises:
            ValueError: ``model`` with row shards, or any rank's failure (with
                ``blocking=False`` at ``wait()``, the next save or, unraised, at exit).
        """
        if model is not None and self.sharded:
            raise ValueError(
                "the model's weights are row shards; save them with "
                "gradsync_torch.save_param_shards(path, model, elementwise_optimizer) and this "
                "optimizer's state with save(path) without model="
            )
        names = self._names(model)
        snapshot = checkpoint.Snapshot(
            optimizer=optimizer_name(self.inner_class),
            step=self._steps,
            shard_gradients=False,
            names=names,
            specs=self.specs,
            plan=self.owner_plan.shard_plan(),
            param_groups=self.param_groups,
            pieces=self._pieces(),
            model=model,
        )
        return checkpoint.save(path, snapshot, self._ranks, blocking=blocking)

    def load(
        self,
        path: str | os.PathLike[str],
        *,
        model: nn.Module | None = None,
        allow_nonfinite: bool = False,
        allow_dtype_conversion: bool = False,
    ) -> None:
        """Load a checkpoint of this optimizer class written at any world size (a
        collective); each owner reads its matrices' state. On any error every rank raises
        and nothing changes.

        Args:
            model: whole tensors only: receives the stored weights, if any.
            allow_nonfinite: take NaN or inf in the state as it is.
            allow_dtype_conversion: cast state of another dtype to the parameter's.
        """
        names = self._names(model)
        target = checkpoint.LoadTarget(
            optimizer_class=self.inner_class,
            names=names,
            specs=self.specs,
            param_groups=self.param_groups,
            shapes=self._shapes(),
            needed={m.index for m in self.matrices if m.whole is not None},
            model=None if self.sharded else model,
            policy=checkpoint.ValuePolicy(allow_nonfinite, allow_dtype_conversion),
        )
        loaded = checkpoint.load(path, target, self._ranks)
        if loaded.model is not None and model is not None:
            copy_weights(model, loaded.model)
        self._set_state(loaded.state, loaded.param_groups)
        self._steps = loaded.step
