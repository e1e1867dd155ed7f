"""A Llama-style decoder in torch, and ``parallelize``, which lays it out on a ``Topology``.

The model (``Llama``) is built from a ``LlamaConfig`` (``examples/llama_config.py``) with
torchtitan's Llama 3 weight names, so ``examples/llama_nnx.py`` loads its weights::

    tok_embeddings.weight                      (vocab, dim)
    layers.N.attention_norm.weight             (dim,)
    layers.N.attention.{wq,wk,wv,wo}.weight    (heads*hd, dim), (kv*hd, dim) x2, (dim, heads*hd)
    layers.N.ffn_norm.weight                   (dim,)
    layers.N.feed_forward.{w1,w3}.weight       (ffn, dim); w2: (dim, ffn)
    layers.N.feed_forward.router.weight        (n_experts, dim)          [MoE variant]
    layers.N.feed_forward.experts.{w1,w3}      (n_experts, ffn, dim); w2: (n_experts, dim, ffn)
    norm.weight                                (dim,)
    output.weight                              (vocab, dim); absent when tied

No biases anywhere. The math, written once for both frameworks (all in the parameters'
dtype except where float32 is named, which means "at least float32": a float64 model, as the
tests train, stays float64):

- ``RMSNorm(x) = x * rsqrt(mean(x**2, -1) + eps) * weight``, computed in float32 and cast
  back to ``x``'s dtype.
- Rotary positions, rotate-half form (GPT-NeoX / Hugging Face): for a head of size ``hd``,
  ``inv_freq[i] = rope_theta ** (-2i / hd)`` (``i < hd/2``), ``angle[p] = p * inv_freq``,
  ``cos = concat(cos(angle), cos(angle))``, ``sin`` likewise, and
  ``rope(x) = x * cos + rotate_half(x) * sin`` with
  ``rotate_half(x) = concat(-x[..., hd/2:], x[..., :hd/2])``; applied to queries and keys at
  their absolute positions ``p`` (0-based).
- Attention: ``q = x wq^T``, ``k = x wk^T``, ``v = x wv^T`` reshaped to heads; grouped-query:
  query head ``h`` reads key/value head ``h // (n_heads // n_kv_heads)``; scores
  ``q k^T / sqrt(hd)`` with the causal mask (key position > query position: ``-inf``),
  softmax in float32 over keys, times ``v``, heads concatenated, then ``wo``.
- SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``.
- MoE variant (``n_experts > 0``): ``probs = softmax(router(x))`` in float32; each token goes
  to its ``top_k`` experts of highest probability (``topk``, no renormalization) and its
  output is ``sum_k probs[e_k] * expert_{e_k}(x)``, each expert a SwiGLU MLP
  ``(silu(x w1[e]^T) * (x w3[e]^T)) w2[e]^T``. No auxiliary load-balancing loss.
- Block: ``h = x + attention(attention_norm(x))``; ``out = h + feed_forward(ffn_norm(h))``.
  Model: ``output(norm(layers(tok_embeddings(tokens))))``, the logits.

``parallelize(model, topology, options)`` is torchtitan's ``parallelize_llama`` and
``pipeline_llm`` in one function, over gradsync_torch's public pieces instead of DTensor's
``parallelize_module``: tensor parallelism (``ColumnParallelLinear``/``RowParallelLinear``,
with sequence parallelism), context parallelism (load-balanced sequence chunks, keys and
values gathered over ``cp``), expert parallelism (experts split over ``ep``, tokens
dispatched with ``all_gather_from``/``reduce_scatter_to``), a pipeline (``Pipeline`` on the
plan of ``options.schedule``) and ``fully_shard`` over the data-parallel axis (HSDP where
``dp_replicate > 1``; experts over ``edp``). It returns a ``ParallelLlama``: this rank's model
parts and the step, clip and shared-gradient sums that go with them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from examples.llama_config import LlamaConfig, ParallelOptions, check_layout
from gradsync_core import (
    ParamSpec,
    ReductionPlan,
    Topology,
    plan_pipeline,
    plan_shared_reductions,
)
from gradsync_core.checkpoint import layout_record
from gradsync_torch import (
    ColumnParallelLinear,
    Group,
    Held,
    Pipeline,
    ProcessGroups,
    RowParallelLinear,
    ShardedModule,
    agree_ok,
    agree_on,
    all_gather_from,
    box_of,
    clip_sharded_,
    fully_shard,
    gather_from,
    param_specs,
    reduce_scatter_to,
    scatter_to,
    shared_param_specs,
)

# ---- the model ----------------------------------------------------------------------------


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or wider (float64 stays float64: the tests' precision)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x**2) + eps) * weight``, in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = _wide(x)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * _wide(self.weight)).type_as(x)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary positions, rotate-half form, on ``x`` of shape ``(batch, seq, heads, hd)``."""
    hd = x.shape[-1]
    wide = torch.promote_types(x.dtype, torch.float32)
    inv_freq = theta ** (-torch.arange(0, hd, 2, dtype=wide) / hd)
    angle = positions.to(wide)[:, None] * inv_freq[None, :]
    cos = torch.cat([angle.cos(), angle.cos()], -1)[None, :, None, :]
    sin = torch.cat([angle.sin(), angle.sin()], -1)[None, :, None, :]
    rotated = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    return (_wide(x) * cos + _wide(rotated) * sin).type_as(x)


def cp_positions(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """The positions context-parallel rank ``cp_rank`` holds: chunks ``cp_rank`` and
    ``2 cp - 1 - cp_rank`` of ``2 cp`` equal chunks (load-balanced for the causal mask, as
    Megatron-core's and torchtitan's context parallelism); all of them when ``cp == 1``."""
    if cp == 1:
        return torch.arange(seq_len)
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    last_start = (2 * cp - 1 - cp_rank) * chunk
    return torch.cat([first, torch.arange(last_start, last_start + chunk)])


def cp_shard(x: torch.Tensor, cp_rank: int, cp: int, *, dim: int = 1) -> torch.Tensor:
    """This context-parallel rank's tokens of ``x`` (``cp_positions`` along ``dim``)."""
    return x.index_select(dim, cp_positions(x.shape[dim], cp_rank, cp))


class Attention(nn.Module):
    """Causal grouped-query attention with rotary positions; ``cp`` gathers keys and values
    over the context-parallel group (set by ``parallelize``)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hd = config.head_dim
        self.head_dim, self.theta = hd, config.rope_theta
        self.n_rep = config.n_heads // config.n_kv_heads
        self.wq: nn.Module = nn.Linear(config.dim, config.n_heads * hd, bias=False)
        self.wk: nn.Module = nn.Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.wv: nn.Module = nn.Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.wo: nn.Module = nn.Linear(config.n_heads * hd, config.dim, bias=False)
        self.cp: Group | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        b, seq = q.shape[:2]  # seq: this rank's tokens (under sequence parallelism, gathered)
        q, k, v = (t.view(b, seq, -1, self.head_dim) for t in (q, k, v))
        cp, cp_rank = (1, 0) if self.cp is None else (self.cp.size, self.cp.group_rank)
        positions = cp_positions(seq * cp, cp_rank, cp)
        q, k = rope(q, positions, self.theta), rope(k, positions, self.theta)
        keys = positions
        if cp > 1:
            assert self.cp is not None
            # Keys and values of the whole sequence: all_gather_from's backward reduce-scatters
            # each rank's partial gradient of them back to their owners.
            k = all_gather_from(k, self.cp, dim=1)
            v = all_gather_from(v, self.cp, dim=1)
            keys = torch.cat([cp_positions(seq * cp, r, cp) for r in range(cp)])
        k, v = k.repeat_interleave(self.n_rep, 2), v.repeat_interleave(self.n_rep, 2)
        scores = torch.einsum("bqhd,bkhd->bhqk", _wide(q), _wide(k)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(keys[None, :] > positions[:, None], float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), _wide(v)).type_as(x)
        return self.wo(out.reshape(b, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1: nn.Module = nn.Linear(dim, hidden, bias=False)
        self.w2: nn.Module = nn.Linear(hidden, dim, bias=False)
        self.w3: nn.Module = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts stacked (torchtitan's ``GroupedExperts`` shapes); this rank
    holds those of its ``ep`` coordinate, declared split over ``"ep"`` (as gradsync's
    ``ExpertMLPs``), so the shared-gradient plan treats them as experts."""

    expert_params = ("w1", "w2", "w3")

    def __init__(self, dim: int, hidden: int, n_experts: int, group: Group | None = None) -> None:
        super().__init__()
        ep = 1 if group is None else group.size
        self.n_experts, self.group = n_experts, group
        self.local_experts = n_experts // ep
        self.first_expert = 0 if group is None else group.group_rank * self.local_experts
        local = self.local_experts
        self.w1 = nn.Parameter(torch.empty(local, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(local, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(local, hidden, dim))
        for weight in (self.w1, self.w2, self.w3):  # nn.Linear's bound, per expert
            bound = 1.0 / math.sqrt(weight.shape[2])
            nn.init.uniform_(weight, -bound, bound)
        self._declare()

    def _declare(self) -> None:
        for name in self.expert_params:
            getattr(self, name).gradsync_sharded_over = ("ep",)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._declare()

    def local_shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts of the serial layer's ``name`` (all experts stacked)."""
        return full[self.first_expert : self.first_expert + self.local_experts].clone()

    def forward(
        self, tokens: torch.Tensor, index: torch.Tensor, gate: torch.Tensor
    ) -> torch.Tensor:
        """``sum_k gate[:, k] * expert_{index[:, k]}(token)`` over the experts held here.

        Args:
            tokens: ``(n, dim)``; index, gate: ``(n, top_k)`` global expert ids and weights.
        """
        out = torch.zeros_like(tokens)
        for local in range(self.local_experts):
            # No skip for an expert without tokens: every rank reduces the same gradients.
            rows, slot = (index == self.first_expert + local).nonzero(as_tuple=True)
            x = tokens[rows]
            y = (F.silu(x @ self.w1[local].T) * (x @ self.w3[local].T)) @ self.w2[local].T
            out = out.index_add(0, rows, y * gate[rows, slot, None].type_as(y))
        return out


class MoEFeedForward(nn.Module):
    """Top-``k`` mixture of SwiGLU experts: a dense router and ``GroupedExperts`` over ``ep``.

    Token dispatch is gradsync's ``MoE``'s (Megatron-core's all-gather dispatcher): the ``ep``
    group gathers its tokens and router probabilities, each rank applies the experts it holds,
    and a reduce-scatter returns each token's output to its owner.
    """

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(_wide(self.router(tokens)), dim=-1)
        group = self.experts.group
        if group is not None and group.size > 1:
            count = tokens.shape[0] * group.size
            tokens = all_gather_from(tokens, group, dim=0, size=count)
            probs = all_gather_from(probs, group, dim=0, size=count)
        gate, index = probs.topk(self.top_k, dim=-1)
        out = self.experts(tokens, index, gate)
        if group is not None and group.size > 1:
            out = reduce_scatter_to(out, group, dim=0)
        return out.reshape(x.shape)


class TransformerBlock(nn.Module):
    """``h = x + attention(attention_norm(x))``; ``h + feed_forward(ffn_norm(h))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward: FeedForward | MoEFeedForward
        if config.n_experts:
            self.feed_forward = MoEFeedForward(
                config.dim, config.ffn_dim, config.n_experts, config.top_k
            )
        else:
            self.feed_forward = FeedForward(config.dim, config.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """The decoder: ``output(norm(layers(tok_embeddings(tokens))))``.

    A pipeline stage is a ``Llama`` without some of its parts (torchtitan's way): the first
    stage has ``tok_embeddings``, the last ``norm`` and ``output``, each its own layers (the
    ``layers`` dict keeps the model's layer numbers, so names stay the model's).

    Args:
        config: the shape.
        seed: the weights' seed (the same model on every rank).

    Example:
        >>> model = Llama(LlamaConfig(dim=32, n_layers=2))
        >>> model(torch.zeros(1, 8, dtype=torch.long)).shape
        torch.Size([1, 8, 128])
    """

    def __init__(self, config: LlamaConfig, *, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(config) for i in range(config.n_layers)}
        )
        self.norm: RMSNorm | None = RMSNorm(config.dim, config.norm_eps)
        self.output: nn.Module | None = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Set by parallelize: the tensor-parallel group and whether the residual stream holds
        # a 1/tp slice of the sequence (sequence parallelism).
        self.tp: Group | None = None
        self.sequence_parallel = False
        # The axes that split this model's tokens: the shared-gradient sums derive from it.
        self.gradsync_data_axes: tuple[str, ...] = ("cp",)

    def blocks(self) -> list[TransformerBlock]:
        """The layers, typed (``self.layers`` is an ``nn.ModuleDict``)."""
        return [cast(TransformerBlock, block) for block in self.layers.values()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's tokens (the last stage), or the residual stream."""
        h = x
        if self.tok_embeddings is not None:
            if self.sequence_parallel and self.tp is not None:
                # This rank's slice of the sequence, plainly: the embedding's gradient is
                # then partial over tp, and the derived plan sums it.
                seq = x.shape[1] // self.tp.size
                x = x[:, self.tp.group_rank * seq : (self.tp.group_rank + 1) * seq]
            h = self.tok_embeddings(x)
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self._logits(h)
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        assert self.output is not None
        if not isinstance(self.output, ColumnParallelLinear):
            return self.output(h)
        # Vocabulary split over tp: gather it; under sequence parallelism keep this rank's
        # slice of the sequence (the tokens whose loss share it computes).
        logits = gather_from(self.output(h), self.output.group, dim=-1)
        if not self.sequence_parallel:
            return logits
        return scatter_to(logits, self.output.group, dim=1)

    def stage(self, layers: Sequence[str], *, first: bool, last: bool) -> Llama:
        """A pipeline stage of this model: the same modules, some left out (no copies)."""
        part = Llama.__new__(Llama)
        nn.Module.__init__(part)
        part.config = self.config
        part.tok_embeddings = self.tok_embeddings if first else None
        part.layers = nn.ModuleDict({name: self.layers[name] for name in layers})
        part.norm = self.norm if last else None
        part.output = self.output if last else None
        part.tp, part.sequence_parallel = self.tp, self.sequence_parallel
        part.gradsync_data_axes = self.gradsync_data_axes
        return part


def lm_loss_share(logits: torch.Tensor, targets: torch.Tensor, tokens: int) -> torch.Tensor:
    """This rank's share of its replica's next-token loss: the cross-entropy summed over the
    tokens it holds, divided by the replica's token count ``tokens`` (along an axis that
    splits the tokens the shares add up to the mean; docs/model-parallel.md)."""
    ce = F.cross_entropy(_wide(logits.flatten(0, 1)), targets.flatten(), reduction="sum")
    return ce / tokens


def local_state(model: nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's pieces of the serial model's tensors ``full`` (tensor-parallel slices,
    its experts), under ``model``'s names; names ``model`` lacks are left out."""
    owners = {}
    for prefix, module in model.named_modules():
        if hasattr(module, "local_shard"):
            for name, _ in module.named_parameters(recurse=False):
                owners[f"{prefix}.{name}" if prefix else name] = (module, name)
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    out = {}
    for key in names:
        module_name = owners.get(key)
        out[key] = (
            full[key]
            if module_name is None
            else module_name[0].local_shard(module_name[1], full[key])
        )
    return out


# ---- parallelize --------------------------------------------------------------------------


@dataclass
class ParallelLlama:
    """What ``parallelize`` gives one rank: its model parts and how to train them.

    ``parts``: this rank's ``Llama`` parts (the whole model, or its pipeline stages).
    ``groups``: the topology's process groups. ``pipeline``: the ``Pipeline`` when pp > 1.
    ``shared``: each part's derived shared-gradient sums (``plan_shared_reductions``).
    ``owned``: each part's parameters whose piece here counts in the gradient norm.
    """

    config: LlamaConfig
    topology: Topology
    options: ParallelOptions
    groups: ProcessGroups
    parts: list[Llama]
    pipeline: Pipeline | None
    shared: list[ReductionPlan]
    owned: list[frozenset[str]]
    seq_len: int

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's share of its replica's loss on ``targets``' rows (a microbatch's
        under a pipeline): ``lm_loss_share`` over ``rows * seq_len`` tokens."""
        return lm_loss_share(logits, targets, targets.shape[0] * self.seq_len)

    def parameters(self) -> Iterator[nn.Parameter]:
        for part in self.parts:
            yield from part.parameters()

    @property
    def has_last_stage(self) -> bool:
        return any(part.output is not None for part in self.parts)

    def local_batch(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's rows (its dp replica's) and tokens (its cp chunk; under sequence
        parallelism the targets of its tp slice) of the global batch."""
        topo, groups = self.topology, self.groups
        rows = tokens.shape[0] // topo.dp
        dp_rank = groups.group_rank("dp")
        tokens, targets = (t[dp_rank * rows : (dp_rank + 1) * rows] for t in (tokens, targets))
        cp, cp_rank = topo.cp, groups.group_rank("cp")
        tokens, targets = cp_shard(tokens, cp_rank, cp), cp_shard(targets, cp_rank, cp)
        if self.options.sequence_parallel and topo.tp > 1:
            seq = targets.shape[1] // topo.tp
            tp_rank = groups.group_rank("tp")
            targets = targets[:, tp_rank * seq : (tp_rank + 1) * seq]
        return tokens, targets

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of the global batch (every rank passes the whole batch and
        takes its part), then the shared-gradient sums. Returns this rank's loss share (the
        sum of its microbatches' on the last stage; ``None`` on other stages)."""
        tokens, targets = self.local_batch(tokens, targets)
        if self.pipeline is not None:
            losses = self.pipeline.step(tokens, target=targets)
            loss = None if losses is None else torch.stack(losses).mean()
        else:
            loss = self.loss_fn(self.parts[0](tokens), targets)
            loss.backward()
        for part, plan in zip(self.parts, self.shared, strict=True):
            sum_shared_gradients(part, self.groups, plan)
        return None if loss is None else loss.detach()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient (every piece on every rank)."""
        return clip_grad_norm_(self.parts, self.owned, max_norm)

    def held(self) -> list[Held]:
        """What this rank holds of each of the whole model's parameters (its tensor-parallel
        slice or experts, the rows ``fully_shard`` kept, its stages' layers), for
        ``gradsync_torch.checkpoint.save_boxes`` and ``load_boxes``."""
        shapes = {spec.name: spec.shape for spec in self.specs()}
        seen: set[int] = set()
        out = []
        for part in self.parts:
            for prefix, module in part.named_modules():
                for short, param in module.named_parameters(recurse=False):
                    if id(param) in seen:  # a tied weight: under its first name
                        continue
                    seen.add(id(param))
                    name = f"{prefix}.{short}" if prefix else short
                    dim, offset = _split(module, short)
                    out.append(box_of(name, param, shapes[name], dim=dim, offset=offset))
        return out

    def specs(self) -> list[ParamSpec]:
        """The whole model's parameters (names, shapes, dtype), from a copy on the meta
        device."""
        dtype = next(self.parameters()).dtype
        with torch.random.fork_rng(), torch.device("meta"):
            whole = Llama(self.config).to(dtype)
        return param_specs(whole)

    def layout(self) -> dict[str, Any]:
        """The layout record a checkpoint's manifest keeps (``extra["layout"]``)."""
        pp = self.topology.pp > 1
        return layout_record(
            self.topology,
            framework="torch",
            schedule=self.options.schedule if pp else None,
            microbatches=self.options.microbatches if pp else None,
            model=asdict(self.config),
        )


def _split(module: nn.Module, name: str) -> tuple[int | None, int]:
    """The dim a layer's parameter ``name`` is cut along on this rank, and where its slice
    starts: tensor-parallel weights (``split_dim``, this rank's chunk) and experts."""
    if isinstance(module, ColumnParallelLinear | RowParallelLinear) and name == "weight":
        rank = module.group.group_rank
        return module.split_dim, sum(module.sizes[:rank])
    if isinstance(module, GroupedExperts) and name in module.expert_params:
        return 0, module.first_expert
    return None, 0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def sum_shared_gradients(part: nn.Module, groups: ProcessGroups, plan: ReductionPlan) -> None:
    """The derived sums of replicated parameters' partial gradients (a norm under sequence
    or context parallelism) over their groups, on the local pieces.

    ``gradsync_torch.reduce_shared_gradients`` runs the same plan on plain gradients; under
    ``fully_shard`` a rank holds rows of each gradient, and every member of a tensor or
    context-parallel group holds the same rows (they share the data-parallel coordinate),
    so the sum runs on the rows. The experts' ``"edp"`` mean is ``fully_shard``'s over
    ``edp``, its divide factor set to ``dp`` (see ``parallelize``), so that reduction is
    skipped here.
    """
    params = dict(part.named_parameters())
    for reduction in plan.reductions:
        group = groups.group(reduction.group)
        grads = [params[s.name].grad for s in reduction.buckets.slots]
        pieces = [_local(g) for g in grads if g is not None]
        if reduction.group == "edp" or group.size == 1 or not pieces:
            continue
        flat = torch.cat([p.reshape(-1) for p in pieces])
        dist.all_reduce(flat, group=group.process_group)
        offset = 0
        for piece in pieces:
            piece.copy_(flat[offset : offset + piece.numel()].view_as(piece))
            offset += piece.numel()


def _owned(part: nn.Module, topology: Topology, rank: int) -> frozenset[str]:
    """The parameters whose piece on this rank counts in the global norm: the first of the
    ranks holding the same piece (replicas over ``dp_replicate``, ``cp``, and ``tp`` for a
    parameter not split over it: ``shared_param_specs``'s ``replicated_over``; experts are
    split over ``ep`` and sharded over ``edp``, so ``dp_replicate`` does not replicate them).
    Read from the layers' declarations before ``fully_shard`` replaces the parameters."""
    coords = topology.coordinates(rank)
    out = set()
    for spec in shared_param_specs(part, data_axes=("tp", "cp")):
        # replicated_over: cp, and tp unless the layer splits the parameter over it.
        replicated = [*spec.replicated_over, *([] if spec.expert else ["dp_replicate"])]
        if all(coords.get(axis, 0) == 0 for axis in replicated):
            out.add(spec.name)
    return frozenset(out)


def clip_grad_norm_(
    parts: Sequence[nn.Module], owned: Sequence[frozenset[str]], max_norm: float
) -> torch.Tensor:
    """Scale every gradient piece by torch's coefficient for the whole model's 2-norm.

    The squares of the pieces one rank of each replica set owns are summed over the world
    (``gradsync_torch.clip_sharded_``'s float64 sum), so a piece held by several ranks counts
    once; every rank then scales all its pieces by the same coefficient.
    """
    mine: list[torch.Tensor] = []
    others: list[torch.Tensor] = []
    for part, names in zip(parts, owned, strict=True):
        for name, p in part.named_parameters():
            if p.grad is not None:
                (mine if name in names else others).append(_local(p.grad))
    dtype = next((g.dtype for g in mine + others), torch.float32)
    total = clip_sharded_(mine, max_norm, 2.0, dtype=dtype, device=torch.device("cpu"), group=None)
    if others:
        torch._foreach_mul_(others, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def _refusal(
    config: LlamaConfig, topology: Topology, options: ParallelOptions, seq_len: int
) -> str | None:
    try:
        check_layout(config, topology, seq_len)
    except ValueError as err:
        return str(err)
    if config.n_experts and (topology.tp > 1 or topology.cp > 1):
        return (
            f"the MoE variant under tp={topology.tp}, cp={topology.cp} is not supported: its "
            "experts are split over ep only; use tp=1 and cp=1 with n_experts > 0"
        )
    if config.tie_embeddings and topology.pp > 1:
        return (
            "a tied embedding under pp > 1 is not supported by parallelize (the pipeline sums "
            "tied gradients only between unsharded stages); set tie_embeddings=False"
        )
    if config.n_experts and topology.dp > 1 and topology.edp == 1:
        return (
            f"ep={topology.ep} equals dp={topology.dp}, so each expert lives on one rank and "
            "fully_shard has no expert data-parallel group to shard it over; use ep < dp"
        )
    return None


def _dp_mesh(groups: ProcessGroups) -> DeviceMesh:
    """The data-parallel mesh ``fully_shard`` takes: 1-D, or ``(dp_replicate, dp_shard)``."""
    topo = groups.topology
    if not topo.hsdp:
        return DeviceMesh.from_group(groups["dp"].process_group, "cpu")
    grid = torch.tensor(groups.ranks("dp")).reshape(topo.dp_replicate, topo.size("dp_shard"))
    pgs = [groups["dp_replicate"].process_group, groups["dp_shard"].process_group]
    return DeviceMesh.from_group(pgs, "cpu", grid, mesh_dim_names=("dp_replicate", "dp_shard"))


def _column(linear: nn.Module, group: Group, sequence_parallel: bool) -> ColumnParallelLinear:
    linear = cast(nn.Linear, linear)
    layer = ColumnParallelLinear(
        linear.in_features,
        linear.out_features,
        group,
        bias=False,
        sequence_parallel=sequence_parallel,
        dtype=linear.weight.dtype,
    )
    with torch.no_grad():
        layer.weight.copy_(layer.local_shard("weight", linear.weight))
    return layer


def _row(linear: nn.Module, group: Group, sequence_parallel: bool) -> RowParallelLinear:
    linear = cast(nn.Linear, linear)
    layer = RowParallelLinear(
        linear.in_features,
        linear.out_features,
        group,
        bias=False,
        sequence_parallel=sequence_parallel,
        dtype=linear.weight.dtype,
    )
    with torch.no_grad():
        layer.weight.copy_(layer.local_shard("weight", linear.weight))
    return layer


def _tensor_parallel(model: Llama, tp: Group, sequence_parallel: bool) -> None:
    """Megatron's layout (torchtitan's plan): wq, wk, wv, w1, w3 and the output column-parallel;
    wo and w2 row-parallel; with sequence parallelism the norms and residuals hold a 1/tp
    slice of the sequence."""
    for layer in model.blocks():
        attn = layer.attention
        attn.wq, attn.wk, attn.wv = (
            _column(attn.wq, tp, sequence_parallel),
            _column(attn.wk, tp, sequence_parallel),
            _column(attn.wv, tp, sequence_parallel),
        )
        attn.wo = _row(attn.wo, tp, sequence_parallel)
        ff = cast(FeedForward, layer.feed_forward)
        ff.w1, ff.w3 = _column(ff.w1, tp, sequence_parallel), _column(ff.w3, tp, sequence_parallel)
        ff.w2 = _row(ff.w2, tp, sequence_parallel)
    if not model.config.tie_embeddings:
        assert isinstance(model.output, nn.Linear)
        model.output = _column(model.output, tp, sequence_parallel)
    model.tp, model.sequence_parallel = tp, sequence_parallel
    if sequence_parallel:
        model.gradsync_data_axes = ("cp", "tp")


def _expert_parallel(model: Llama, ep: Group) -> None:
    for layer in model.blocks():
        moe = cast(MoEFeedForward, layer.feed_forward)
        serial = moe.experts
        local = GroupedExperts(serial.w1.shape[2], serial.w1.shape[1], serial.n_experts, ep)
        local.to(serial.w1.dtype)
        with torch.no_grad():
            for name in GroupedExperts.expert_params:
                getattr(local, name).copy_(local.local_shard(name, getattr(serial, name)))
        moe.experts = local


def parallelize(
    model: Llama,
    topology: Topology,
    options: ParallelOptions = ParallelOptions(),  # noqa: B008  # frozen
    *,
    seq_len: int,
) -> ParallelLlama:
    """Lay ``model`` out on ``topology``: torchtitan's ``parallelize_llama``, gradsync's pieces.

    Call on every rank with the same serial model (the same seed) and the same arguments: the
    ranks first agree on the config, the topology and the options (one sentence on every
    rank where any differs, before any group is made), then every axis is applied in
    torchtitan's order: tensor (and sequence) parallelism, context parallelism, expert
    parallelism, the pipeline cut, ``fully_shard`` over the data-parallel axis (each layer,
    then each part; HSDP when ``dp_replicate > 1``; experts over ``edp`` with the dense
    ``dp`` as divide factor).

    Args:
        model: the serial ``Llama``; its modules are reused (do not use it afterwards).
        topology: the axis sizes; ``topology.world_size`` is the world's.
        options: microbatches and schedule (pp > 1), sequence parallelism, resharding.
        seq_len: the sequence length trained on (checked against cp and tp).

    Returns:
        A ``ParallelLlama``.

    Raises:
        ValueError: on every rank, one sentence: a layout ``check_layout`` refuses, a
            composition this function does not support, ranks with different configs,
            topologies or options.
    """
    config = model.config
    agree_ok(_refusal(config, topology, options, seq_len), None, what="parallelize")
    payload = {
        "config": asdict(config),
        "topology": topology.to_json(),
        "options": asdict(options),
        "seq_len": seq_len,
    }
    agree_on(payload, None, describe=_describe_mismatch)
    groups = ProcessGroups(topology)
    if topology.tp > 1:
        _tensor_parallel(model, groups["tp"], options.sequence_parallel)
    if topology.cp > 1:
        for layer in model.blocks():
            layer.attention.cp = groups["cp"]
    if topology.ep > 1:
        _expert_parallel(model, groups["ep"])
    plan = None
    if topology.pp > 1:
        plan = plan_pipeline(
            schedule=options.schedule,
            microbatches=options.microbatches,
            topology=topology,
            layers=config.n_layers,
            zero3=topology.dp > 1,
        )
        pp_rank = groups.group_rank("pp")
        stages: dict[int, Llama] = {}
        first_layer = 0
        for index, stage in enumerate(plan.stages):
            count = sum(letter in "tm" for letter in stage.layout)
            names = [str(i) for i in range(first_layer, first_layer + count)]
            first_layer += count
            if stage.rank == pp_rank:
                last = index == plan.num_stages - 1
                stages[index] = model.stage(names, first=index == 0, last=last)
        parts = list(stages.values())
    else:
        parts = [model]
    shared = [plan_shared_reductions(shared_param_specs(part), topology) for part in parts]
    owned = [_owned(part, topology, groups.rank) for part in parts]
    if topology.dp > 1:
        mesh = _dp_mesh(groups)
        for part in parts:
            for layer in part.blocks():
                if config.n_experts and groups.size("edp") > 1:
                    experts = cast(MoEFeedForward, layer.feed_forward).experts
                    edp = groups["edp"].process_group
                    sharded = cast(ShardedModule, fully_shard(experts, process_group=edp))
                    # The expert gradient's mean is over the dense dp (docs/design.md §6).
                    sharded.set_gradient_divide_factor(float(topology.dp))
                fully_shard(layer, mesh=mesh, reshard_after_forward=options.reshard_after_forward)
            fully_shard(part, mesh=mesh, reshard_after_forward=options.reshard_after_forward)
    result = ParallelLlama(
        config=config,
        topology=topology,
        options=options,
        groups=groups,
        parts=parts,
        pipeline=None,
        shared=shared,
        owned=owned,
        seq_len=seq_len,
    )
    if plan is not None:
        result.pipeline = Pipeline(plan, stages, groups=groups, loss_fn=result.loss_fn)
    return result


def _describe_mismatch(d: Any) -> str:
    base, other = d.base, d.other
    key = next(k for k in base if base[k] != other[k])
    return (
        f"parallelize: rank {d.other_rank} has another {key} than rank {d.base_rank} "
        f"({other[key]} vs {base[key]}); start every rank with the same model and topology"
    )
