"""The Llama reference decoder's parameters, one rank's slice of them, and their bytes per rank.

``examples/llama_torch.py`` (and its Flax NNX twin) lay the model out as torchtitan's
``parallelize_llama`` does; this module says, from the model's sizes alone, what each rank
then holds (docs/nd-parallel.md):

- ``pp``: torchtitan's partition of the layers over one stage per pipeline rank
  (``partition_layers``: the embedding and the norm-and-output count as a layer each); the
  first stage holds ``tok_embeddings``, the last ``norm`` and ``output``.
- ``tp``: Megatron's cut. ``wq``, ``wk``, ``wv``, ``w1``, ``w3`` and ``output`` are
  column-parallel (torch's ``(out, in)`` weight cut along dim 0), ``wo`` and ``w2``
  row-parallel (dim 1); the embedding, the norms and the router are replicated over tp.
- ``ep``: each rank holds ``n_experts / ep`` of every layer's stacked experts (dim 0).
- ``dp_shard`` (and ``edp`` for experts): ``fully_shard`` cuts what the rank holds along dim 0,
  one unit per layer and the stage's root (``plan_param_shards``, ``estimate_zero3``); under a
  pipeline the stage is gathered whole for the step and its gradients accumulate unsharded
  over the microbatches (``_staged``).
- ``cp`` divides no parameter: it splits the sequence, so activations only.

Given the batch (``Activations``), each row also counts the activations the rank holds at its
peak: the tensors torch's autograd saves for the backward of one microbatch on the stage
(``LlamaShape.activation_bytes``: the formula and how it was checked are in
docs/nd-parallel.md), times the pipeline plan's peak stash of the rank (one microbatch, the
rank's whole batch, without a pipeline).

A model's names alone do not say how it splits over tp or which layers a stage holds, so
``gradsync plan`` divides by tp, pp and ep for these shapes only (``LLAMA_MODELS``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from gradsync_core.plan._memory import RankMemory, estimate_zero3
from gradsync_core.plan._param_shards import ParamShardPlan, plan_param_shards
from gradsync_core.plan._param_units import block_prefixes
from gradsync_core.plan._specs import ParamSpec, itemsize
from gradsync_core.plan._topology import Topology
from gradsync_core.plan.pipeline._layout import partition_layers
from gradsync_core.plan.pipeline._plan import plan_pipeline

EXECUTORS = ("torch", "jax")  # Activations.executor: whose program the activations are
_TOKEN_BYTES = 8  # the token ids and targets torch's embedding and loss save: int64

# Megatron's tensor-parallel cut of a layer's weights: the dim of torch's (out, in) weight.
_COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
_ROW = ("attention.wo", "feed_forward.w2")


@dataclass(frozen=True, slots=True, kw_only=True)
class Activations:
    """The training batch whose activations a composed estimate counts.

    Args:
        batch: the global batch, in rows (sequences), split over the data-parallel ranks.
        seq_len: the sequence length, split over ``cp`` (and ``tp`` under sequence
            parallelism).
        schedule: with ``pp > 1``, the pipeline schedule (one stage per rank: ``1F1B``,
            ``GPipe``), whose peak stash is counted.
        microbatches: with ``pp > 1``, microbatches per step; each rank's rows are split into
            them. Must be 1 without a pipeline.
        sequence_parallel: the reference's ``ParallelOptions.sequence_parallel`` (its default):
            with ``tp > 1`` the residual stream holds ``1/tp`` of the tokens and each
            column-parallel layer gathers its own copy of its input.
        executor: whose program saves them: ``"torch"`` (``examples/llama_torch.py``: autograd's
            saved tensors, each column-parallel layer gathering its own input under sequence
            parallelism, FSDP2's units gathered and freed one at a time) or ``"jax"``
            (``examples/llama_nnx.py``'s ``parallelize``: one sequence-parallel gather per
            attention and per MLP, shared by its column-parallel layers, and without a
            pipeline the stage's ``dp_shard`` gathers kept from the forward to the backward,
            the whole stage gathered: XLA saves each all-gather's output as a residual).
    """

    batch: int
    seq_len: int
    schedule: str | None = None
    microbatches: int = 1
    sequence_parallel: bool = True
    executor: str = "torch"

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(
                f"executor {self.executor!r} is not one of {', '.join(EXECUTORS)}; pick one"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaShape:
    """The sizes of ``examples/llama_config.py``'s ``LlamaConfig`` that fix the parameters.

    Example:
        >>> tiny = LlamaShape(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
        ...                   ffn_dim=64)
        >>> sum(s.numel for s in tiny.specs())
        41248
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    n_experts: int = 0
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def specs(self, dtype: str = "float32") -> list[ParamSpec]:
        """Every parameter with torchtitan's names, in ``named_parameters()`` order; a tied
        output weight is listed once, as the embedding's."""
        d, hd = self.dim, self.head_dim
        table: list[tuple[str, tuple[int, ...], bool]] = [
            ("tok_embeddings.weight", (self.vocab_size, d), False)
        ]
        for i in range(self.n_layers):
            p = f"layers.{i}"
            table += [
                (f"{p}.attention_norm.weight", (d,), False),
                (f"{p}.attention.wq.weight", (self.n_heads * hd, d), False),
                (f"{p}.attention.wk.weight", (self.n_kv_heads * hd, d), False),
                (f"{p}.attention.wv.weight", (self.n_kv_heads * hd, d), False),
                (f"{p}.attention.wo.weight", (d, self.n_heads * hd), False),
                (f"{p}.ffn_norm.weight", (d,), False),
            ]
            if self.n_experts:
                e, h = self.n_experts, self.ffn_dim
                table += [
                    (f"{p}.feed_forward.router.weight", (e, d), False),
                    (f"{p}.feed_forward.experts.w1", (e, h, d), True),
                    (f"{p}.feed_forward.experts.w2", (e, d, h), True),
                    (f"{p}.feed_forward.experts.w3", (e, h, d), True),
                ]
            else:
                table += [
                    (f"{p}.feed_forward.w1.weight", (self.ffn_dim, d), False),
                    (f"{p}.feed_forward.w2.weight", (d, self.ffn_dim), False),
                    (f"{p}.feed_forward.w3.weight", (self.ffn_dim, d), False),
                ]
        table.append(("norm.weight", (d,), False))
        if not self.tie_embeddings:
            table.append(("output.weight", (self.vocab_size, d), False))
        return [ParamSpec(name=n, shape=s, dtype=dtype, expert=e) for n, s, e in table]

    def check(self, topology: Topology) -> None:
        """Refuse, with one sentence, sizes the axes do not divide (``check_layout``'s rule).

        Raises:
            ValueError: heads, kv heads, ffn_dim or an untied vocabulary not divisible by tp,
                layers too few for pp, experts not divisible by ep, ep without experts.
        """
        splits = [
            ("n_heads", self.n_heads, "tp", topology.tp),
            ("n_kv_heads", self.n_kv_heads, "tp", topology.tp),
            ("ffn_dim", self.ffn_dim, "tp", topology.tp),
        ]
        if not self.tie_embeddings:
            splits.append(("vocab_size", self.vocab_size, "tp", topology.tp))
        if self.n_experts:
            splits.append(("n_experts", self.n_experts, "ep", topology.ep))
        elif topology.ep > 1:
            raise ValueError(f"ep={topology.ep} needs a model with experts (n_experts > 0)")
        if self.n_experts and topology.tp > 1:
            raise ValueError(
                "the Llama reference does not cut experts over tp (examples/llama_torch.py "
                "refuses tp with experts); use tp 1 with experts"
            )
        for what, size, axis, parts in splits:
            if size % parts:
                raise ValueError(
                    f"{what} {size} is not divisible by {axis}={parts}: pick a {axis} that "
                    "divides it"
                )
        if self.tie_embeddings and topology.pp > 1:
            raise ValueError(
                "a tied embedding under pp > 1 is not supported by the Llama reference's "
                "parallelize; set tie_embeddings=False or pp 1"
            )
        partition_layers(self.n_layers, topology.pp)  # refuses more stages than layers

    def stage_layers(self, pp: int) -> tuple[range, ...]:
        """The layers of each pipeline rank's stage (torchtitan's partition, one stage per
        rank), e.g. ``(range(0, 2), range(2, 4))`` for 4 layers over pp 2."""
        out, first = [], 0
        for stage in partition_layers(self.n_layers, pp):
            count = stage.count("t")
            out.append(range(first, first + count))
            first += count
        return tuple(out)

    def activation_bytes(
        self,
        topology: Topology,
        *,
        rows: int,
        seq_len: int,
        layers: int,
        first: bool = True,
        last: bool = True,
        pipelined: bool = False,
        sequence_parallel: bool = True,
        dtype: str = "float32",
        shared_gather: bool = False,
    ) -> int:
        """The bytes torch's autograd saves for the backward of ``rows`` sequences through a
        stage of ``layers`` blocks on one rank of ``examples/llama_torch.py``'s layout
        (docs/nd-parallel.md, "Activations"): per block, with ``s`` the tokens of the rank's
        context chunk (``seq_len / cp``), ``r`` the residual stream's (``s / tp`` under
        sequence parallelism, else ``s``), ``e`` the dtype's bytes and ``w`` the wider of it
        and float32 (norms, rotary tables, attention scores are computed in ``w``)::

            norms      2 x (2 r dim w + r w)       input, normalised input, rsqrt; twice
            linear in  c s dim e                   c = 5 (wq, wk, wv, w1, w3 each gather
                                                   their input) under sp with tp > 1, else 2
                                                   (also with ``shared_gather``: one gather
                                                   per attention and MLP, JAX's program)
            rotary     4 s head_dim w              cos and sin, for queries and keys
            attention  (h s + 2 h seq_len) hd w    queries; keys and values of the whole
                                                   sequence, repeated to h = n_heads / tp
                       + h s seq_len w + s seq_len  softmax output; causal mask (bool)
                       + h hd s e                  wo's input
            mlp        4 s (ffn_dim / tp) e        w1 and w3 outputs, silu output, w2's input

        all times ``rows``, except the rotary tables, the mask and, in a dtype narrower than
        float32, each norm's weight copied to float32 (``dim w``). The first stage adds the
        embedding's token ids (``8 s`` per row: int64, the context chunk the sp slice views);
        the last the final norm, the output's input (``s dim e`` per row, gathered under sp),
        the log-softmax of the whole vocabulary (``r vocab w``), the targets (``8 r``) and one
        scalar; a pipeline stage also keeps what it returned until its backward: the residual
        stream (``r dim e`` per row), or on the last stage the logits (``r vocab e`` per
        row; ``s vocab e`` for a single row under sp, whose slice views the gathered logits).

        Raises:
            ValueError: the MoE variant (not counted), or ``seq_len`` not divisible by ``cp``
                (``2 cp`` with cp) or, under sequence parallelism, its chunk by ``tp``.
        """
        if self.n_experts:
            raise ValueError(
                "activations are counted for the dense Llama only; plan the MoE variant "
                "without --batch/--seq"
            )
        tp, cp = topology.tp, topology.cp
        sp = sequence_parallel and tp > 1
        unit = math.lcm(2 * cp if cp > 1 else 1, cp * tp if sp else 1)
        if seq_len % unit:
            raise ValueError(
                f"seq_len {seq_len} does not split over cp={cp} (into 2 cp chunks with cp) and, "
                f"under sequence parallelism, tp={tp}; pick a multiple of {unit}"
            )
        e = itemsize(dtype)
        w = max(e, 4)
        s = seq_len // cp
        r = s // tp if sp else s
        h, hd, d = self.n_heads // tp, self.head_dim, self.dim
        copies = 5 if sp and not shared_gather else 2
        per_row = (
            2 * (2 * r * d * w + r * w)
            + copies * s * d * e
            + (h * s + 2 * h * seq_len) * hd * w
            + h * s * seq_len * w
            + h * hd * s * e
            + 4 * s * (self.ffn_dim // tp) * e
        )
        widened = d * w if w != e else 0  # a norm's weight, copied to float32 when narrower
        fixed = 4 * s * hd * w + s * seq_len + 2 * widened
        total = layers * (rows * per_row + fixed)
        if first:
            total += rows * s * _TOKEN_BYTES
        if last:
            head = 2 * r * d * w + r * w + s * d * e
            head += r * self.vocab_size * w + r * _TOKEN_BYTES
            total += rows * head + w + widened
        if pipelined and not last:
            total += rows * r * d * e
        elif pipelined:
            # One row's slice of the gathered logits is a view of them: they stay whole.
            kept = s if sp and rows == 1 else rows * r
            total += kept * self.vocab_size * e
        return total

    def rank_specs(
        self, topology: Topology, pp_rank: int, dtype: str = "float32"
    ) -> list[ParamSpec]:
        """What one rank of pipeline rank ``pp_rank`` holds before ``fully_shard``: its stage's
        parameters, each its tp slice and its ep share of the experts.

        Raises:
            ValueError: ``check``'s refusals, or a ``pp_rank`` outside ``[0, pp)``.
        """
        self.check(topology)
        if not 0 <= pp_rank < topology.pp:
            raise ValueError(f"pp_rank must be in [0, {topology.pp}), got {pp_rank}")
        layers = {f"layers.{i}." for i in self.stage_layers(topology.pp)[pp_rank]}
        first, last = pp_rank == 0, pp_rank == topology.pp - 1
        out = []
        for spec in self.specs(dtype):
            head = spec.name.split(".", 1)[0]
            if head == "layers":
                if f"layers.{spec.name.split('.')[1]}." not in layers:
                    continue
            elif head == "tok_embeddings" and not first:
                continue
            elif head in ("norm", "output") and not last:
                continue
            shape = list(spec.shape)
            cut = _tp_dim(spec.name)
            if cut is not None:
                shape[cut] //= topology.tp
            if spec.expert:
                shape[0] //= topology.ep
            out.append(
                ParamSpec(name=spec.name, shape=tuple(shape), dtype=dtype, expert=spec.expert)
            )
        return out


def _tp_dim(name: str) -> int | None:
    """The dim tensor parallelism cuts of a parameter, or ``None`` (replicated over tp)."""
    if name == "output.weight":
        return 0
    module = name.rsplit(".", 1)[0].split(".", 2)[-1] if name.startswith("layers.") else ""
    if module in _COLUMN:
        return 0
    if module in _ROW:
        return 1
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class StageMemory:
    """The bytes of the fullest rank of one pipeline stage (a rank of pipeline rank
    ``pp_rank``: every tp, cp and dp rank of it holds the same or less)."""

    pp_rank: int
    layers: range
    numel: int  # the elements this rank holds before fully_shard: its tp/ep slice of the stage
    memory: RankMemory
    activation_bytes: int = 0  # the activations at the rank's peak stash (0: not counted)
    stash: int = 0  # microbatches whose activations it holds at once (0: not counted)

    @property
    def peak_bytes(self) -> int:
        """Model states at their peak plus the activations of the peak stash."""
        return self.memory.peak_bytes + self.activation_bytes


def llama_memory(
    shape: LlamaShape,
    topology: Topology,
    *,
    dtype: str = "float32",
    optimizer: str | int = "adamw",
    activations: Activations | None = None,
) -> tuple[StageMemory, ...]:
    """Per-rank bytes of the Llama reference on ``topology``, one row per pipeline
    rank: its stage's tp/ep slices cut by ``fully_shard`` over ``dp`` (HSDP: ``dp_shard``
    ranks per shard group), one unit per layer and the stage's root; the experts over
    ``edp``, each layer's experts a unit of their own. The dense and expert estimates add up,
    their transient bytes too (an upper bound: the two peaks need not coincide). With
    ``activations``, each row adds the activation bytes of the rank's peak stash
    (``stash_activations``).

    Raises:
        ValueError: ``LlamaShape.check``'s refusals, or ``stash_activations``'.

    Example:
        >>> tiny = LlamaShape(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
        ...                   ffn_dim=64)
        >>> rows = llama_memory(tiny, Topology.create(8, tp=2, pp=2))
        >>> [(r.pp_rank, list(r.layers), r.numel) for r in rows]
        [(0, [0, 1], 11392), (1, [2, 3], 10400)]
    """
    out = []
    for pp_rank, layers in enumerate(shape.stage_layers(topology.pp)):
        specs = shape.rank_specs(topology, pp_rank, dtype)
        dense = [s for s in specs if not s.expert]
        experts = [s for s in specs if s.expert]
        plan = plan_param_shards(
            dense, world_size=topology.dp, units=block_prefixes(dense), dp_shard=topology.dp_shard
        )
        total = _staged(estimate_zero3(plan, optimizer=optimizer).max, plan, topology)
        if experts:
            units = sorted({s.name.rsplit(".", 1)[0] for s in experts})
            expert_plan = plan_param_shards(experts, world_size=topology.edp, units=units)
            extra = _staged(
                estimate_zero3(expert_plan, optimizer=optimizer).max, expert_plan, topology
            )
            total = RankMemory(
                rank=total.rank,
                parameter_bytes=total.parameter_bytes + extra.parameter_bytes,
                gradient_bytes=total.gradient_bytes + extra.gradient_bytes,
                optimizer_state_bytes=total.optimizer_state_bytes + extra.optimizer_state_bytes,
                transient_bytes=total.transient_bytes + extra.transient_bytes,
            )
        numel = sum(s.numel for s in specs)
        out.append(StageMemory(pp_rank=pp_rank, layers=layers, numel=numel, memory=total))
    if activations is None:
        return tuple(out)
    stashed = stash_activations(shape, topology, activations, dtype=dtype)
    if activations.executor == "jax" and topology.pp == 1 and not shape.n_experts:
        out = [
            replace(row, memory=_kept_gathered(row.memory, shape, topology, dtype)) for row in out
        ]
    return tuple(
        replace(row, stash=stash, activation_bytes=stash * per_microbatch)
        for row, (stash, per_microbatch) in zip(out, stashed, strict=True)
    )


def _kept_gathered(
    memory: RankMemory, shape: LlamaShape, topology: Topology, dtype: str
) -> RankMemory:
    """The JAX ``parallelize``'s transient bytes without a pipeline: each parameter's
    ``dp_shard`` all-gather is a residual of its backward (XLA keeps the gathered value from
    the forward), so the whole stage is gathered at the start of the backward, while each
    gradient is reduce-scattered as the backward produces it. With nothing sharded, the
    estimate as it is."""
    specs = shape.rank_specs(topology, 0, dtype)
    plan = plan_param_shards(
        specs, world_size=topology.dp, units=block_prefixes(specs), dp_shard=topology.dp_shard
    )
    if plan.shard_size == 1:
        return memory
    gathered = sum(plan.shard_size * plan.unit_padded_nbytes(u.index) for u in plan.units)
    return replace(memory, transient_bytes=gathered)


def _staged(memory: RankMemory, plan: ParamShardPlan, topology: Topology) -> RankMemory:
    """A pipeline stage's transient bytes: its pipeline plan gathers the whole stage before
    its first forward and frees it after its last backward (``UNSHARD``/``RESHARD``), and its
    gradients accumulate unsharded over the microbatches until the last backward
    reduce-scatters them (``gradsync_torch``'s ``Pipeline``, FSDP2's accumulation): every
    unit gathered, every unit's full gradients, and the largest unit's reduce-scatter input.
    Without a pipeline, or with nothing sharded, ``estimate_zero3``'s per-unit moment."""
    if topology.pp == 1 or plan.shard_size == 1:
        return memory
    n = plan.shard_size
    gathered = sum(n * plan.unit_padded_nbytes(u.index) for u in plan.units)
    grads = [n * plan.unit_padded_nbytes(u.index, trainable_only=True) for u in plan.units]
    return replace(memory, transient_bytes=gathered + sum(grads) + max(grads, default=0))


def stash_activations(
    shape: LlamaShape, topology: Topology, activations: Activations, *, dtype: str = "float32"
) -> tuple[tuple[int, int], ...]:
    """``(peak stash, activation bytes per microbatch)`` of each pipeline rank: without a
    pipeline ``(1, the rank's whole batch)``; with one, the peak stash of
    ``plan_pipeline``'s plan (as ``examples/llama_torch.py`` plans it) and one microbatch of
    the rank's stage (``LlamaShape.activation_bytes``).

    Raises:
        ValueError: a batch the data-parallel ranks and microbatches do not divide, a
            pipeline without a schedule, microbatches without a pipeline, a schedule of
            several stages per rank, or ``activation_bytes``' refusals.
    """
    a = activations
    stages = shape.stage_layers(topology.pp)
    if topology.pp == 1:
        if a.microbatches != 1 or a.schedule is not None:
            raise ValueError(
                "microbatches and a schedule apply to a pipeline; leave them out with pp 1"
            )
        stash: tuple[int, ...] = (1,)
    else:
        if a.schedule is None:
            raise ValueError(
                f"pp={topology.pp} holds the activations its schedule stashes; name the "
                "schedule (1F1B, GPipe) and the microbatches"
            )
        plan = plan_pipeline(
            schedule=a.schedule,
            microbatches=a.microbatches,
            topology=topology,
            layers=shape.n_layers,
            zero3=topology.dp > 1,
        )
        if plan.stages_per_rank != 1:
            raise ValueError(
                f"schedule {a.schedule} runs {plan.stages_per_rank} stages per rank; the "
                "composed estimate has one stage per rank (1F1B, GPipe)"
            )
        stash = plan.peak_stash
    parts = topology.dp * a.microbatches
    if a.batch < 1 or a.batch % parts:
        raise ValueError(
            f"batch {a.batch} does not split into dp {topology.dp} x {a.microbatches} "
            f"microbatches of whole rows; pick a multiple of {parts}"
        )
    rows = a.batch // parts
    pp = topology.pp
    return tuple(
        (
            stash[i],
            shape.activation_bytes(
                topology,
                rows=rows,
                seq_len=a.seq_len,
                layers=len(layers),
                first=i == 0,
                last=i == pp - 1,
                pipelined=pp > 1,
                sequence_parallel=a.sequence_parallel,
                dtype=dtype,
                shared_gather=a.executor == "jax",
            ),
        )
        for i, layers in enumerate(stages)
    )


LLAMA_MODELS: dict[str, LlamaShape] = {
    # Meta's Llama 3 8B (torchtitan's "8B" flavor): 8,030,261,248 parameters.
    "llama3-8b": LlamaShape(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
    ),
    # examples/llama_nd.py's model, dense and with --moe.
    "llama-nd": LlamaShape(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64),
    "llama-nd-moe": LlamaShape(
        vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=32, n_experts=4
    ),
    # benchmarks/nd_parallel.py's model: large enough that model states dominate its peak.
    "llama-nd-bench": LlamaShape(
        vocab_size=2048, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=768
    ),
}
