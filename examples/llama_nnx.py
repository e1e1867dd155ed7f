"""The Llama-style reference decoder in Flax NNX, and ``parallelize`` for it (issue 37).

The model is ``examples/llama_config.py``'s ``LlamaConfig`` under torchtitan's Llama 3 names
(``tok_embeddings``, ``layers.i.attention.{wq,wk,wv,wo}``, ``attention_norm``, ``ffn_norm``,
``feed_forward.{w1,w2,w3}``, ``norm``, ``output``), so ``gradsync_jax.to_torch_state`` gives
the torch model's names and layouts (a Flax ``kernel`` is torch's ``weight`` transposed,
``scale`` and ``embedding`` are ``weight``). The MoE variant (``n_experts > 0``) has
``layers.i.feed_forward.router`` and ``layers.i.feed_forward.experts.{w1,w2,w3}``, stacked
over experts in torch's layout (``w1``/``w3`` ``(experts, ffn_dim, dim)``, ``w2``
``(experts, dim, ffn_dim)``).

Every module takes an ``Axes`` record at call time: ``SERIAL`` (no mesh: the reference model
on one device) or the mesh axes a ``jax.shard_map`` splits the work over, where the forward
applies gradsync_jax's model-parallel mappings (``copy_to``, ``reduce_from``,
``all_gather_from``, ``reduce_scatter_to``): the parameter tree is the same either way, and
the kernels carry their tensor/expert-parallel role as ``out_sharding`` (``"tp"`` on a
column's output features or a row's input features, ``"ep"`` on the experts). As in
``examples/llama_torch.py`` (torchtitan's plan), ``output`` is column-parallel: each tp device
holds ``1/tp`` of the vocabulary; the training loss is computed without gathering the logits
(``vocab_parallel_loss_sum``), ``vocab_parallel_logits`` gathers them.
``parallelize`` (below) turns the roles into mesh axes and builds the training step.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from examples.llama_config import LlamaConfig, ParallelOptions, check_layout
from gradsync_core import Manifest, PipelinePlan, SaveHandle, Topology, plan_pipeline
from gradsync_core.checkpoint import layout_record
from gradsync_jax import (
    NotElementwiseError,
    PipelineModel,
    all_gather_from,
    cast_varying,
    compile_ticks,
    copy_to,
    gather_from,
    global_norm_args,
    load_boxes,
    mesh_from_topology,
    natural_params,
    pipeline_params,
    pipeline_specs,
    reduce_from,
    reduce_scatter_to,
    run_pipeline,
    save_boxes,
    scatter_to,
    shard_optimizer,
    split_microbatches,
    varying,
)

TP, EP = "tp", "ep"  # the roles a kernel's out_sharding names (parallelize maps them to axes)
COLUMN, ROW = (None, TP), (TP, None)  # a Flax kernel is (in, out)


@dataclass(frozen=True)
class Axes:
    """The mesh axes a forward is split over inside ``jax.shard_map`` (``None``: not split).

    Args:
        tp: tensor parallelism: attention heads and the MLP's hidden units.
        cp: context parallelism: the sequence, in load-balanced chunks (``cp_positions``).
        ep: expert parallelism: the experts of every MoE layer, and the tokens routed to them.
        sequence_parallel: with ``tp``, norms and residuals hold a ``1/tp`` chunk of each
            context chunk (the tokens arrive split over ``(cp, tp)``).
    """

    tp: str | None = None
    cp: str | None = None
    ep: str | tuple[str, ...] | None = None
    sequence_parallel: bool = False


SERIAL = Axes()


def _size(axis: str | tuple[str, ...] | None) -> int:
    return 1 if axis is None else lax.axis_size(axis)


def _enter(x: jax.Array, ax: Axes) -> jax.Array:
    """The residual stream into a tensor-parallel region (Megatron's ``f``, or the sequence
    parallel all-gather)."""
    if ax.tp is None:
        return x
    return all_gather_from(x, ax.tp, dim=1) if ax.sequence_parallel else copy_to(x, ax.tp)


def _leave(y: jax.Array, ax: Axes) -> jax.Array:
    """A row-parallel layer's partial sums back into the residual stream (``g``)."""
    if ax.tp is None:
        return y
    return reduce_scatter_to(y, ax.tp, dim=1) if ax.sequence_parallel else reduce_from(y, ax.tp)


def _linear(d_in: int, d_out: int, role: tuple[Any, ...] | None, rngs: nnx.Rngs) -> nnx.Linear:
    meta: Mapping[str, Any] = (
        {} if role is None else {"out_sharding": role, "eager_sharding": False}
    )
    return nnx.Linear(d_in, d_out, use_bias=False, kernel_metadata=meta, rngs=rngs)


def rms_norm(dim: int, eps: float, rngs: nnx.Rngs) -> nnx.RMSNorm:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dimension, in float32."""
    return nnx.RMSNorm(dim, epsilon=eps, use_fast_variance=False, rngs=rngs)


def rotate(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary positions in the rotate-half form: ``x * cos + rotate_half(x) * sin``.

    ``x`` is ``(batch, seq, heads, head_dim)``; frequency ``i`` (of ``head_dim / 2``) is
    ``theta ** (-2 i / head_dim)``, applied to the pair ``(x[i], x[i + head_dim / 2])``.
    """
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(0, half, dtype=jnp.float32) * 2 / x.shape[-1])
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]  # (seq, half)
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[None, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[None, :, None, :]
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(x.dtype)


def cp_positions(seq_len: int, cp: int) -> jax.Array:
    """``(cp, seq_len / cp)``: row ``r`` the positions context-parallel rank ``r`` holds,
    chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp`` equal chunks (load-balanced for the causal
    mask, as Megatron-core's and torchtitan's context parallelism; ``parallelize`` orders the
    sequence so that the contiguous split over ``cp`` gives them)."""
    chunks = jnp.arange(seq_len).reshape(2 * cp, seq_len // (2 * cp))
    return jnp.concatenate([chunks[:cp], chunks[cp:][::-1]], axis=1)


class Attention(nnx.Module):
    """Causal grouped-query attention: ``n_kv_heads`` key/value heads, each shared by
    ``n_heads / n_kv_heads`` query heads (torchtitan's ``repeat_kv``)."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        hd = cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, hd
        self.rope_theta = cfg.rope_theta
        self.wq = _linear(cfg.dim, cfg.n_heads * hd, COLUMN, rngs)
        self.wk = _linear(cfg.dim, cfg.n_kv_heads * hd, COLUMN, rngs)
        self.wv = _linear(cfg.dim, cfg.n_kv_heads * hd, COLUMN, rngs)
        self.wo = _linear(cfg.n_heads * hd, cfg.dim, ROW, rngs)

    def __call__(self, x: jax.Array, ax: Axes = SERIAL) -> jax.Array:
        h = _enter(x, ax)  # this context chunk's whole sequence
        b, s, _ = h.shape
        tp, hd = _size(ax.tp), self.head_dim
        q = self.wq(h).reshape(b, s, self.n_heads // tp, hd)
        k = self.wk(h).reshape(b, s, self.n_kv_heads // tp, hd)
        v = self.wv(h).reshape(b, s, self.n_kv_heads // tp, hd)
        positions = jnp.arange(s)
        if ax.cp is not None:  # load-balanced chunks; every chunk's keys and values
            cp = lax.axis_size(ax.cp)
            positions = cp_positions(s * cp, cp)[lax.axis_index(ax.cp)]
        q, k = rotate(q, positions, self.rope_theta), rotate(k, positions, self.rope_theta)
        key_positions = positions
        if ax.cp is not None:
            k, v = all_gather_from(k, ax.cp, dim=1), all_gather_from(v, ax.cp, dim=1)
            key_positions = cp_positions(s * cp, cp).reshape(-1)
        repeat = self.n_heads // self.n_kv_heads
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        causal = positions[:, None] >= key_positions[None, :]
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1)
        return _leave(self.wo(out), ax)


class FeedForward(nnx.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``; ``w1``, ``w3`` column- and ``w2`` row-parallel."""

    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs) -> None:
        self.w1 = _linear(dim, hidden, COLUMN, rngs)
        self.w2 = _linear(hidden, dim, ROW, rngs)
        self.w3 = _linear(dim, hidden, COLUMN, rngs)

    def __call__(self, x: jax.Array, ax: Axes = SERIAL) -> jax.Array:
        h = _enter(x, ax)
        return _leave(self.w2(jax.nn.silu(self.w1(h)) * self.w3(h)), ax)


class Experts(nnx.Module):
    """``n_experts`` SwiGLU MLPs stacked in torch's layout, split over ``ep`` on dim 0."""

    def __init__(self, dim: int, hidden: int, n_experts: int, *, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2, batch_axis=(0,))

        def param(shape: tuple[int, ...]) -> nnx.Param:
            value = init(rngs.params(), shape, jnp.float32)
            return nnx.Param(value, out_sharding=(EP, None, None), eager_sharding=False)

        self.w1 = param((n_experts, hidden, dim))
        self.w2 = param((n_experts, dim, hidden))
        self.w3 = param((n_experts, hidden, dim))


class MoE(nnx.Module):
    """Top-``top_k`` mixture of SwiGLU experts: each token's output is the sum of its
    ``top_k`` highest-scoring experts' outputs, each scaled by its softmax score.

    Under ``ax.ep`` the dispatch is gradsync_jax's MoE's (Megatron-core's all-gather
    dispatcher): the ``ep`` group's tokens and scores are gathered, each device applies its
    own experts to the tokens routed to them and the outputs are reduce-scattered back.
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.top_k = cfg.top_k
        self.router = _linear(cfg.dim, cfg.n_experts, None, rngs)
        self.experts = Experts(cfg.dim, cfg.ffn_dim, cfg.n_experts, rngs=rngs)

    def __call__(self, x: jax.Array, ax: Axes = SERIAL) -> jax.Array:
        tokens = x.reshape(-1, x.shape[-1])
        scores = jax.nn.softmax(self.router(tokens).astype(jnp.float32), axis=-1)
        w1, w2, w3 = self.experts.w1[...], self.experts.w2[...], self.experts.w3[...]
        first: int | jax.Array = 0
        if ax.ep is not None:
            count = tokens.shape[0] * lax.axis_size(ax.ep)
            tokens = all_gather_from(tokens, ax.ep, dim=0, size=count)
            scores = all_gather_from(scores, ax.ep, dim=0, size=count)
            first = lax.axis_index(ax.ep) * w1.shape[0]
        top, index = lax.top_k(scores, self.top_k)
        out = jnp.zeros_like(tokens)
        for e in range(w1.shape[0]):  # every local expert on every token, masked: static shapes
            weight = jnp.where(index == first + e, top, 0.0).sum(-1)[:, None]
            y = (jax.nn.silu(tokens @ w1[e].T) * (tokens @ w3[e].T)) @ w2[e].T
            out = out + weight.astype(y.dtype) * y
        if ax.ep is not None:
            out = reduce_scatter_to(out, ax.ep, dim=0)
        return out.reshape(x.shape)


class TransformerBlock(nnx.Module):
    """``h = x + attention(attention_norm(x)); h + feed_forward(ffn_norm(h))`` (``feed_forward``
    a ``MoE`` in the MoE variant)."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.attention_norm = rms_norm(cfg.dim, cfg.norm_eps, rngs)
        self.attention = Attention(cfg, rngs=rngs)
        self.ffn_norm = rms_norm(cfg.dim, cfg.norm_eps, rngs)
        mlp = MoE(cfg, rngs=rngs) if cfg.n_experts else FeedForward(cfg.dim, cfg.ffn_dim, rngs=rngs)
        self.feed_forward = mlp

    def __call__(self, x: jax.Array, ax: Axes = SERIAL) -> jax.Array:
        h = x + self.attention(self.attention_norm(x), ax)
        return h + self.feed_forward(self.ffn_norm(h), ax)


class Llama(nnx.Module):
    """The decoder: ``tok_embeddings``, ``layers``, ``norm``, ``output`` (absent when tied:
    the logits are then ``h @ tok_embeddings.embedding.T``).

    Example:
        >>> model = Llama(LlamaConfig(dim=32, n_layers=2), rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((2, 16), jnp.int32)).shape
        (2, 16, 128)
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.config = cfg  # static: not a parameter
        self.tok_embeddings = nnx.Embed(cfg.vocab_size, cfg.dim, rngs=rngs)
        self.layers = nnx.List([TransformerBlock(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.norm = rms_norm(cfg.dim, cfg.norm_eps, rngs)
        tied = cfg.tie_embeddings
        self.output = None if tied else _linear(cfg.dim, cfg.vocab_size, COLUMN, rngs)

    def logits(self, h: jax.Array) -> jax.Array:
        """The output layer on the final norm's output."""
        if self.output is None:
            return h @ self.tok_embeddings.embedding[...].T
        return self.output(h)

    def __call__(self, tokens: jax.Array, ax: Axes = SERIAL) -> jax.Array:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, ax)
        return self.logits(self.norm(h))


def vocab_parallel_logits(output: nnx.Linear, h: jax.Array, ax: Axes = SERIAL) -> jax.Array:
    """The column-parallel ``output`` layer on ``h`` (torch's ``Llama._logits``): each ``tp``
    device computes its ``1/tp`` of the vocabulary, gathered into the whole logits; under
    sequence parallelism ``h`` is this device's slice of the sequence, gathered first, and
    the result is this device's slice again (the tokens whose loss share it computes)."""
    if ax.tp is None:
        return output(h)
    logits = gather_from(output(_enter(h, ax)), ax.tp, dim=-1)
    return scatter_to(logits, ax.tp, dim=1) if ax.sequence_parallel else logits


def vocab_parallel_loss_sum(
    output: nnx.Linear, h: jax.Array, targets: jax.Array, ax: Axes = SERIAL
) -> jax.Array:
    """``token_loss_sum`` of the column-parallel ``output`` layer on ``h`` without gathering
    the logits (Megatron's vocab-parallel cross-entropy, torchtitan's loss parallelism):
    each ``tp`` device keeps its ``1/tp`` of the vocabulary, and the log-sum-exp and the
    target's logit are summed over ``tp`` per token. Under sequence parallelism ``h`` and
    ``targets`` are this device's slice of the sequence, gathered first (the output layer's
    input is the whole sequence either way). The result is the same on every ``tp`` device:
    the summed cross-entropy of every token of the ``tp`` group."""
    if ax.tp is None:
        return token_loss_sum(output(h), targets)
    if ax.sequence_parallel:
        targets = lax.all_gather(targets, ax.tp, axis=1, tiled=True)
    local = output(_enter(h, ax)).astype(jnp.float32)  # (batch, seq, vocab / tp)
    v = local.shape[-1]
    top = lax.pmax(lax.stop_gradient(local.max(-1)), ax.tp)
    index = targets - lax.axis_index(ax.tp) * v
    mine = (index >= 0) & (index < v)
    picked = jnp.take_along_axis(local, jnp.clip(index, 0, v - 1)[..., None], -1)[..., 0]
    sums, target = lax.psum(
        (jnp.exp(local - top[..., None]).sum(-1), jnp.where(mine, picked, 0.0)), ax.tp
    )
    return (top + jnp.log(sums) - target).sum()


def token_loss_sum(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """The summed next-token cross-entropy (float32) of the given tokens."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets
    ).sum()


def serial_loss(model: Llama, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    """The reference loss: the mean cross-entropy over every token of the batch."""
    return token_loss_sum(model(tokens), targets) / targets.size


# -- parallelize ---------------------------------------------------------------------------

PARTS = ("embed", "blocks", "head")  # the pipeline's view of the model (gradsync_jax.pipeline)
GATHERED = "gathered"  # the checkpoint name of a parameter all-gathered over dp_shard


@dataclass(frozen=True)
class _Gather:
    """How one parameter's chunk becomes the tensor the forward uses: all-gathered along
    ``dim`` over the data-parallel shard axes ``axes`` (ZeRO-3); ``axes=()``: stored whole."""

    dim: int
    axes: tuple[str, ...]

    def __call__(self, chunk: jax.Array) -> jax.Array:
        # One chunk alone (the tied output's second use of the embedding; ``_merged``
        # gathers a module's chunks together). all_gather_from: its backward is the
        # reduce-scatter, each device's gradient the sum over the shard group of its chunk's.
        if not self.axes:
            return chunk
        return checkpoint_name(all_gather_from(chunk, self.axes, dim=self.dim), GATHERED)


@dataclass(frozen=True)
class ParallelLlama:
    """What ``parallelize`` returns: the mesh, the layout and the step of a training loop.

    Attributes:
        topology, mesh: the topology and its mesh (``mesh_from_topology``).
        axes: the mesh axes the forward splits over (``Axes``).
        plan: the ``PipelinePlan`` with ``pp > 1``, else ``None``.
        param_specs: each stored parameter's ``PartitionSpec`` on ``mesh``: the
            tensor/expert-parallel roles, the ``dp_shard`` axes on torch's dim 0 and, with
            ``pp > 1``, the pipeline layout's leading ``pp`` (``gradsync_jax.pipeline_specs``).
        batch_spec: the tokens' and targets' ``PartitionSpec``: rows over the data-parallel
            axes, the sequence over ``cp`` (and ``tp`` with sequence parallelism).
        place: ``place(params)``: the model's parameters (``nnx.to_pure_dict`` of its
            ``nnx.Param`` state) onto the mesh, in the stored layout.
        init: ``init(stored)``: the optimizer state of placed parameters, placed.
        step: ``step(stored, opt_state, (tokens, targets)) -> (stored, opt_state, loss)``,
            jitted; ``loss`` is the global mean cross-entropy.
        params_of: ``params_of(stored)``: the model's parameter tree, whole, on the host.
        state_of: ``state_of(opt_state)``: the state ``tx.init(params_of(stored))`` has.
        layout: the record a checkpoint's manifest keeps of this layout
            (``gradsync_core.checkpoint.layout_record``: framework, topology, schedule,
            microbatches, the model's config).
        save: ``save(path, stored, opt_state, *, step, data=None, blocking=True)``: a
            checkpoint any layout (or torch's ``load_boxes``) loads, in model space
            (``gradsync_jax.checkpoint.save_boxes``); returns its manifest (a
            ``SaveHandle`` with ``blocking=False``).
        load: ``load(path, *, data=None) -> (stored, opt_state, manifest)``: a checkpoint
            saved under any layout, by either framework, placed in this one
            (``gradsync_jax.checkpoint.load_boxes``); a checkpoint of another model refuses
            with one sentence before anything is placed.
    """

    topology: Topology
    mesh: Mesh
    axes: Axes
    plan: PipelinePlan | None
    param_specs: Any
    batch_spec: P
    place: Callable[[Any], Any]
    init: Callable[[Any], Any]
    step: Callable[[Any, Any, Any], tuple[Any, Any, jax.Array]]
    params_of: Callable[[Any], Any]
    state_of: Callable[[Any], Any]
    layout: dict[str, Any]
    save: Callable[..., Manifest | SaveHandle]
    load: Callable[..., tuple[Any, Any, Manifest]]


def _ep_axes(topology: Topology) -> tuple[str, ...]:
    """The dense mesh's axes whose groups are the topology's expert-parallel groups."""
    want = set(topology.groups("ep"))
    for name in ("dp_shard", "dp_replicate", "dp"):
        axes = topology.mesh_axes(name)
        if axes and set(topology.groups(name)) == want:
            return axes
    raise ValueError(
        f"the expert-parallel groups {sorted(want)} are not the groups of a data-parallel "
        "axis of the dense mesh, which one shard_map needs; make dp_shard (or dp_replicate) "
        "equal to ep"
    )


def _refuse(cfg: LlamaConfig, topology: Topology) -> None:
    """One sentence for each composition this ``parallelize`` does not lay out."""
    if topology.etp != topology.tp:
        raise ValueError(f"etp={topology.etp} differs from tp={topology.tp}; leave etp unset")
    if topology.ep > 1 and topology.tp > 1:
        raise ValueError(
            f"ep={topology.ep} with tp={topology.tp}: the experts are not split over tp here "
            "(no expert tensor parallelism); use tp=1 for the MoE variant"
        )
    if topology.pp > 1 and cfg.tie_embeddings:
        raise ValueError(
            "tie_embeddings with pp > 1: the embedding (first stage) and the output (last "
            "stage) would be one parameter on two pipeline ranks; untie them or use pp=1"
        )


def _spec_axes(spec: P) -> tuple[str, ...]:
    return tuple(a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e))


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _layout(params: Any, roles: Any, topology: Topology, mesh: Mesh, ax: Axes) -> tuple[Any, Any]:
    """(PartitionSpec tree, _Gather tree): roles mapped to mesh axes, then the ``dp_shard``
    axes added on torch's dim 0 (a 2-D kernel's dim 1) of every parameter not already split
    over them (expert weights, whose ``ep`` axis is the ``dp_shard`` axis)."""
    fsdp = topology.mesh_axes("dp_shard") if topology.enabled("dp_shard") else ()
    ep = ax.ep if isinstance(ax.ep, tuple) else ((ax.ep,) if ax.ep else ())
    role_axes = {TP: (ax.tp,) if ax.tp else (), EP: ep}
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    role_of = dict(jax.tree_util.tree_flatten_with_path(roles, is_leaf=_is_spec)[0])
    specs, gathers = [], []
    for path, value in flat:
        entries: list[tuple[str, ...]] = [()] * value.ndim
        for d, role in enumerate(role_of[path]):
            entries[d] = () if role is None else role_axes[role]
        dim = 1 if path[-1] == jax.tree_util.DictKey("kernel") and value.ndim == 2 else 0
        used = {a for e in entries for a in e}
        add = tuple(a for a in fsdp if a not in used)
        entries[dim] = entries[dim] + add
        for d, e in enumerate(entries):
            parts = math.prod(mesh.shape[a] for a in e)
            if value.shape[d] % parts:
                raise ValueError(
                    f"parameter {jax.tree_util.keystr(path)} has {value.shape[d]} along dim "
                    f"{d}, which {e} ({parts} devices) does not divide; pick sizes that do"
                )
        specs.append(P(*(None if not e else e[0] if len(e) == 1 else e for e in entries)))
        gathers.append(_Gather(dim, add))
    unflatten = jax.tree_util.tree_unflatten
    return unflatten(treedef, specs), unflatten(treedef, gathers)


def _check_elementwise(
    tx: optax.GradientTransformation, mesh: Mesh, axes: Any, params: Any
) -> None:
    """Refuse an update that is not exact on chunks (gradsync_jax's ZeRO analysis proves it)."""
    try:
        jax.eval_shape(shard_optimizer(tx, mesh, axis_name=axes, partition="flat").init, params)
    except (NotElementwiseError, ValueError) as err:
        raise ValueError(
            "parallelize runs the optimizer on each device's chunks, which is exact only for "
            "an elementwise update, clipped by gradsync_jax.clip_by_global_norm first in the "
            "chain (optax.chain(gradsync_jax.clip_by_global_norm(1.0), optax.adamw(...))); "
            "this one is not (" + str(err).split("; use ")[0] + ")"
        ) from err


def _parts_of(tree: Any, n_layers: int, blocks: Callable[[list[Any]], Any]) -> dict[str, Any]:
    """The model's tree as the pipeline's ``{"embed", "blocks", "head"}``; ``blocks`` makes
    the blocks' entry from the layers' subtrees (stacked parameters, one layer's specs)."""
    return {
        "embed": {"tok_embeddings": tree["tok_embeddings"]},
        "blocks": blocks([tree["layers"][i] for i in range(n_layers)]),
        "head": {"norm": tree["norm"], "output": tree["output"]},
    }


def _stack(layers: list[Any]) -> Any:
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *layers)


def _from_parts(parts: Any, n_layers: int) -> dict[str, Any]:
    """``_parts_of``'s inverse for stacked parameters (NumPy leaves)."""
    layers = {
        i: jax.tree.map(lambda x, i=i: np.asarray(x)[i], parts["blocks"]) for i in range(n_layers)
    }
    return {"tok_embeddings": parts["embed"]["tok_embeddings"], "layers": layers, **parts["head"]}


def _sum_over(x: jax.Array, axes: Iterable[str]) -> jax.Array:
    """``psum`` over those of ``axes`` that ``x`` varies over (partial values)."""
    over = tuple(a for a in axes if a in varying(x))
    return lax.psum(x, over) if over else x


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gather_group(axes: tuple[str, ...], dims: tuple[int, ...], chunks: tuple[Any, ...]) -> Any:
    """Each of a module's chunks all-gathered along its ``dims`` entry over the ``dp_shard``
    axes ``axes`` (ZeRO-3); the backward sums the module's gradients over ``axes`` in one
    tuple all-reduce and keeps each device's chunk of each (``_gather_group_bwd``)."""
    return tuple(
        lax.all_gather(c, axes, axis=d, tiled=True) for c, d in zip(chunks, dims, strict=True)
    )


def _gather_group_fwd(axes: Any, dims: Any, chunks: Any) -> tuple[Any, None]:
    return _gather_group(axes, dims, chunks), None


def _gather_group_bwd(axes: Any, dims: Any, _: None, grads: Any) -> tuple[Any]:
    # One psum of the module's gradients (XLA's combiner may merge modules' further), not a
    # reduce-scatter per parameter: on XLA:CPU each collective is a rendezvous of every
    # device's thread, and their count, not their bytes, set the dp_shard x tp step's time
    # (docs/nd-parallel.md, "Measured"). The sum is the same; each device keeps its chunk.
    whole, index, n = lax.psum(grads, axes), lax.axis_index(axes), _size(axes)
    return (
        tuple(
            lax.dynamic_slice_in_dim(g, index * (g.shape[d] // n), g.shape[d] // n, d)
            for g, d in zip(whole, dims, strict=True)
        ),
    )


_gather_group.defvjp(_gather_group_fwd, _gather_group_bwd)


def _merged(graphdef: Any, gathers: Any, chunks: Any) -> Any:
    """The module of ``graphdef`` on the whole parameters gathered from ``chunks``: the
    chunks sharded over the same axes gathered together (``_gather_group``), each named
    ``GATHERED`` for ``reshard_after_forward``'s checkpoint policy."""
    flat, treedef = jax.tree.flatten(gathers)
    whole = list(treedef.flatten_up_to(chunks))
    for axes in dict.fromkeys(g.axes for g in flat if g.axes):  # a fixed order on every host
        at = [i for i, g in enumerate(flat) if g.axes == axes]
        dims = tuple(flat[i].dim for i in at)
        gathered = _gather_group(axes, dims, tuple(whole[i] for i in at))
        for i, x in zip(at, gathered, strict=True):
            whole[i] = checkpoint_name(x, GATHERED)
    return nnx.merge(graphdef, treedef.unflatten(whole))


def _embed_rows(chunk: jax.Array, tokens: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """The embedding of ``tokens`` from its ``dp_shard`` chunk of vocabulary rows, without
    gathering the table (GSPMD's lookup of a row-sharded table): the shard group's tokens
    are gathered, each device looks up those in its rows (zeros elsewhere) and the partial
    embeddings are reduce-scattered back to their rows of the batch. The backward gathers
    the group's embedding gradients and adds each device's into its own rows."""
    n_rows = chunk.shape[0]
    every = lax.all_gather(tokens, axes, axis=0, tiled=True)
    index = every - lax.axis_index(axes) * n_rows
    mine = (index >= 0) & (index < n_rows)
    found = jnp.take(chunk, jnp.clip(index, 0, n_rows - 1), axis=0)
    part = jnp.where(mine[..., None], found, jnp.zeros((), chunk.dtype))
    return lax.psum_scatter(part, axes, scatter_dimension=0, tiled=True)


def _graphdef(module: Any) -> Any:
    return nnx.split(module, nnx.Param)[0]


def parallelize(
    model: Llama,
    topology: Topology,
    options: ParallelOptions | None = None,
    *,
    tx: optax.GradientTransformation,
    seq_len: int,
    devices: Any = None,
) -> ParallelLlama:
    """Lay ``model`` out on ``topology`` and build its training step (torchtitan's style).

    One ``jax.shard_map`` over the topology's mesh runs every axis at once: the batch rows
    over the data-parallel axes; the sequence over ``cp`` (keys and values all-gathered,
    causal mask on global positions) and, with ``options.sequence_parallel``, over ``tp``;
    heads, hidden units and the output's vocabulary over ``tp`` (Megatron's column/row
    mappings; the cross-entropy vocab-parallel, the logits never gathered); experts over the
    mesh axis of the topology's ``ep`` groups (all-gather dispatch); every other parameter
    cut over ``dp_shard`` on torch's dim 0 (ZeRO-3: a module's chunks all-gathered where it
    computes, its gradients summed over the shard group in one all-reduce, each device
    keeping its chunk; the untied embedding's rows looked up where they are, not gathered)
    and
    replicated over ``dp_replicate`` (HSDP); with ``pp > 1`` the layers run as a
    ``PipelinePlan`` in gradsync_jax's tick loop, each block gathering its own chunks.
    Gradients of parameters replicated over an axis the data is split on are summed over
    it by JAX's transposes (``check_vma``) or, in the pipeline, once after the tick loop.
    The update runs on each device's chunks, given the global norm summed over every axis
    (``gradsync_jax.clip_by_global_norm``).

    Args:
        model: the ``Llama`` (its parameters are the starting point).
        topology: the axes (``Topology.create(8, tp=2, dp_shard=2, ...)``).
        options: ``ParallelOptions``: ``sequence_parallel``; ``microbatches`` and
            ``schedule`` with ``pp``.
        tx: an elementwise Optax update, ``gradsync_jax.clip_by_global_norm`` first if clipped.
        seq_len: the training sequence length (checked against ``cp`` and ``tp``).
        devices: the mesh's devices in rank order (default ``jax.devices()``).

    Returns:
        A ``ParallelLlama``.

    Raises:
        ValueError: a layout ``check_layout`` refuses, a composition not laid out here (one
            sentence each: etp != tp, ep with tp, ep groups that are not a data-parallel
            mesh axis, tied embeddings with pp), a dimension its axes do not divide, or an
            update that is not exact on chunks.
    """
    options = ParallelOptions() if options is None else options
    cfg: LlamaConfig = model.config
    check_layout(cfg, topology, seq_len)
    _refuse(cfg, topology)
    mesh = mesh_from_topology(topology, devices)
    sp = options.sequence_parallel and topology.tp > 1
    ax = Axes(
        tp="tp" if topology.tp > 1 else None,
        cp="cp" if topology.cp > 1 else None,
        ep=_ep_axes(topology) if topology.ep > 1 else None,
        sequence_parallel=sp,
    )
    state = nnx.state(model, nnx.Param)
    natural = nnx.to_pure_dict(state)
    roles = nnx.to_pure_dict(nnx.get_partition_spec(state))
    specs, gathers = _layout(natural, roles, topology, mesh, ax)
    data = topology.mesh_axes("dp")
    seq = tuple(a for a in (ax.cp, ax.tp if sp else None) if a is not None)
    batch_spec = P(data, seq or None)
    _check_elementwise(tx, mesh, data, natural)
    plain_tx, tx = tx, optax.with_extra_args_support(tx)
    named = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    n_layers, stored_specs, plan = cfg.n_layers, specs, None
    if topology.pp > 1:
        plan = plan_pipeline(
            schedule=options.schedule,
            microbatches=options.microbatches,
            topology=topology,
            layers=n_layers,
            input_weight=0,
            output_weight=0,
        )
        part_specs = _parts_of(specs, n_layers, lambda layers: layers[0])
        part_gathers = _parts_of(gathers, n_layers, lambda layers: layers[0])
        stored_specs = pipeline_specs(_parts_of(natural, n_layers, _stack), part_specs)

    def state_specs(opt_state: Any) -> Any:
        return optax.tree_map_params(
            tx, lambda _, s: s, opt_state, stored_specs, transform_non_params=lambda _: P()
        )

    def update(chunks: Any, opt_state: Any, grads: Any, norm_axes: Any) -> tuple[Any, Any]:
        squares = jax.tree.map(lambda g, a: lax.psum(jnp.sum(jnp.square(g)), a), grads, norm_axes)
        norm = jnp.sqrt(sum(jax.tree.leaves(squares)))
        updates, opt_state = tx.update(grads, opt_state, chunks, **global_norm_args(grads, norm))
        return optax.apply_updates(chunks, updates), opt_state

    def loss_share(logits: jax.Array, targets: jax.Array, count: int) -> jax.Array:
        return token_loss_sum(logits, targets) / count  # this device's share of the mean

    embed_def, block_def = _graphdef(model.tok_embeddings), _graphdef(model.layers[0])
    norm_def = _graphdef(model.norm)
    output_def = None if model.output is None else _graphdef(model.output)

    def block_of(layer_gathers: Any) -> Callable[[Any, jax.Array], jax.Array]:
        """A layer on its chunks: gathered, run, and with ``reshard_after_forward`` the
        gathered parameters dropped (gathered again for the backward, FSDP2's default)."""

        def block(chunks: Any, h: jax.Array) -> jax.Array:
            return _merged(block_def, layer_gathers, chunks)(h, ax)

        if not options.reshard_after_forward:
            return block
        return jax.checkpoint(
            block, policy=jax.checkpoint_policies.save_anything_except_these_names(GATHERED)
        )

    def local_step(chunks: Any, opt_state: Any, tokens: Any, targets: Any, count: int) -> Any:
        def local_loss(chunks: Any) -> jax.Array:
            embedding = gathers["tok_embeddings"]
            rows = embedding["embedding"]
            if output_def is not None and rows.axes and rows.dim == 0:
                h = _embed_rows(chunks["tok_embeddings"]["embedding"], tokens, rows.axes)
            else:  # stored whole, or tied: gathered (the output uses it again)
                h = _merged(embed_def, embedding, chunks["tok_embeddings"])(tokens)
            for i in range(n_layers):
                h = block_of(gathers["layers"][i])(chunks["layers"][i], h)
            h = _merged(norm_def, gathers["norm"], chunks["norm"])(h)
            if output_def is None:  # tied: the embedding gathered again, as torch's FSDP2
                logits = h @ embedding["embedding"](chunks["tok_embeddings"]["embedding"]).T
            else:
                output = _merged(output_def, gathers["output"], chunks["output"])
                return vocab_parallel_loss_sum(output, h, targets, ax) / count
            return loss_share(logits, targets, count)

        loss, grads = jax.value_and_grad(local_loss)(chunks)
        # JAX's transposes summed every gradient over the axes its chunk is replicated on;
        # the norm sums each chunk's squares over the axes it is split on.
        norm_axes = jax.tree.map(_spec_axes, specs, is_leaf=_is_spec)
        chunks, opt_state = update(chunks, opt_state, grads, norm_axes)
        return chunks, opt_state, _sum_over(loss, mesh.axis_names)

    def local_pipeline_step(
        chunks: Any, opt_state: Any, tokens: Any, targets: Any, count: int
    ) -> Any:
        assert plan is not None and output_def is not None
        head_gathers = part_gathers["head"]

        def head(p: Any, h: jax.Array, t: jax.Array) -> jax.Array:
            h = _merged(norm_def, head_gathers["norm"], p["norm"])(h)
            output = _merged(output_def, head_gathers["output"], p["output"])
            loss = vocab_parallel_loss_sum(output, h, t, ax) / count  # the same on every tp
            if ax.sequence_parallel:  # the tick loop's values vary over tp: a 1/tp share each
                loss = cast_varying(loss / lax.axis_size(ax.tp), (ax.tp,))
            return loss

        fns = PipelineModel(
            embed=lambda p, t: _merged(embed_def, part_gathers["embed"], p)(t),
            block=block_of(part_gathers["blocks"]),
            head=head,
        )
        run_axes = ("pp", *data, *seq)
        own = cast_varying(tuple(jax.tree.map(lambda x: x[0], chunks[k]) for k in PARTS), run_axes)
        inputs, outputs = split_microbatches((tokens, targets), plan.microbatches)
        loss, (d_embed, d_blocks, d_head) = run_pipeline(
            fns,
            program,
            own,
            inputs,
            outputs,
            blocks_per_stage=n_layers // plan.num_stages,
            stash="residuals",
            axes=run_axes,
        )
        # The embedding's (head's) gradient is on the first (last) stage's rank only.
        d_embed, d_head, loss = lax.psum((d_embed, d_head, loss), "pp")
        grads = {"embed": d_embed, "blocks": d_blocks, "head": d_head}
        grads = jax.tree.map(
            lambda g, s: _sum_over(g, (a for a in run_axes[1:] if a not in _spec_axes(s))),
            grads,
            part_specs,
        )
        grads = cast_varying(jax.tree.map(lambda g: g[None], grads), ("pp",))
        # the embedding and head are copies on every pipeline rank: count them once
        norm_axes = {
            k: jax.tree.map(
                lambda s, k=k: tuple(a for a in _spec_axes(s) if k == "blocks" or a != "pp"),
                stored_specs[k],
                is_leaf=_is_spec,
            )
            for k in PARTS
        }
        chunks, opt_state = update(chunks, opt_state, grads, norm_axes)
        return chunks, opt_state, _sum_over(loss, mesh.axis_names)

    if plan is not None:
        program = compile_ticks(plan)
    body = local_step if plan is None else local_pipeline_step

    @jax.jit
    def step(stored: Any, opt_state: Any, batch: Any) -> Any:
        tokens, targets = batch
        if ax.cp is not None:  # the contiguous split over cp gives each rank its chunks
            order = cp_positions(tokens.shape[1], topology.cp).reshape(-1)
            tokens, targets = tokens[:, order], targets[:, order]
        s_specs = state_specs(opt_state)
        stored = jax.reshard(stored, jax.tree.map(named, stored_specs, is_leaf=_is_spec))
        opt_state = jax.reshard(opt_state, jax.tree.map(named, s_specs, is_leaf=_is_spec))
        tokens, targets = jax.reshard((tokens, targets), named(batch_spec))
        mapped = jax.shard_map(
            partial(body, count=targets.size),
            mesh=mesh,
            in_specs=(stored_specs, s_specs, batch_spec, batch_spec),
            out_specs=(stored_specs, s_specs, P()),
        )
        return mapped(stored, opt_state, tokens, targets)

    def place(params: Any) -> Any:
        if plan is None:
            return jax.device_put(params, jax.tree.map(named, specs, is_leaf=_is_spec))
        return pipeline_params(_parts_of(params, n_layers, _stack), plan, mesh, part_specs)

    def init(stored: Any) -> Any:
        opt_state = tx.init(stored)
        return jax.device_put(
            opt_state, jax.tree.map(named, state_specs(opt_state), is_leaf=_is_spec)
        )

    def params_of(stored: Any) -> Any:
        if plan is None:
            return jax.tree.map(np.asarray, stored)
        return _from_parts(natural_params(stored, plan), n_layers)

    def state_of(opt_state: Any) -> Any:
        if plan is None:
            return jax.tree.map(np.asarray, opt_state)
        is_parts = lambda x: isinstance(x, dict) and set(x) == set(PARTS)  # noqa: E731
        return jax.tree.map(
            lambda x: params_of(x) if is_parts(x) else np.asarray(x), opt_state, is_leaf=is_parts
        )

    record = layout_record(
        topology,
        framework="jax",
        schedule=options.schedule,
        microbatches=options.microbatches,
        model=dataclasses.asdict(cfg),
    )
    natural_shardings = jax.tree.map(named, specs, is_leaf=_is_spec)

    def save(
        path: str | os.PathLike[str],
        stored: Any,
        opt_state: Any,
        *,
        step: int,
        data: Any = None,
        blocking: bool = True,
    ) -> Manifest | SaveHandle:
        if plan is not None:  # the stages' layers as the model's tree, laid out without pp
            stored = jax.device_put(params_of(stored), natural_shardings)
            opt_state = state_of(opt_state)
        return save_boxes(
            path, stored, opt_state, plain_tx, step=step, layout=record, data=data,
            blocking=blocking,
        )  # fmt: skip

    def load(path: str | os.PathLike[str], *, data: Any = None) -> tuple[Any, Any, Manifest]:
        like = jax.tree.map(
            lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            natural,
            natural_shardings,
        )
        params, opt_state, manifest = load_boxes(path, like, plain_tx, data=data)
        if plan is None:
            return params, opt_state, manifest
        # the model's tree into the pipeline's: each parameter-shaped subtree of the state too
        structure = jax.tree.structure(natural)
        is_tree = lambda x: jax.tree.structure(x) == structure  # noqa: E731
        opt_state = jax.tree.map(
            lambda x: place(x) if is_tree(x) else x, opt_state, is_leaf=is_tree
        )
        shardings = jax.tree.map(named, state_specs(opt_state), is_leaf=_is_spec)
        return place(params), jax.device_put(opt_state, shardings), manifest

    return ParallelLlama(
        topology=topology,
        mesh=mesh,
        axes=ax,
        plan=plan,
        param_specs=stored_specs,
        batch_spec=batch_spec,
        place=place,
        init=init,
        step=step,
        params_of=params_of,
        state_of=state_of,
        layout=record,
        save=save,
        load=load,
    )
