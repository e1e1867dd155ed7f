"""Checks of gradsync_torch.DataParallel that run inside spawned gloo ranks.

``test_data_parallel.py`` spawns one group of ranks per world size and runs every check here
in it (spawns cost seconds). Each check compares against a single-process reference (the full
batch on one rank; fp32 tolerance ``REF_TOL``: the sums run in another order) and against
torch DDP on the same model and data (bitwise: same buckets, same arithmetic). This module
holds no tests of its own.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync_torch as gt
from tests.support.asserts import assert_tensors_close

REF_TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32, different summation order
BF16_TOL = {"rtol": 2e-2, "atol": 2e-3}  # bf16 wire: 8-bit mantissa, divide and sum in bf16
FP16_TOL = {"rtol": 2e-3, "atol": 2e-4}
N = 4  # samples per rank


def mlp(seed: int = 0, d_in: int = 6, hidden: int = 10, d_out: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
        nn.Linear(hidden, d_out),
    )  # fmt: skip


def batch(step: int, ws: int, d_in: int = 6, d_out: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(ws * N, d_in, generator=gen), torch.randn(ws * N, d_out, generator=gen)


def shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * N : (rank + 1) * N]


def reference_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, ws: int) -> list:
    """One process, the full batch: the mean over ranks of each rank's mean loss."""
    ref = copy.deepcopy(model)
    loss = sum(F.mse_loss(ref(shard(x, r)), shard(y, r)) for r in range(ws)) / ws
    loss.backward()
    return [p.grad for p in ref.parameters()]


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int) -> None:
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
    if isinstance(model, gt.DataParallel) and not model.options.overlap:
        model.sync_gradients()


def grads(model: nn.Module) -> list:
    return [p.grad for p in model.parameters()]


def assert_equal(a: list, b: list, what: str) -> None:
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x is None or y is None:
            assert x is None and y is None, f"{what}: grad {i} is {x} vs {y}"
        else:
            assert torch.equal(x, y), f"{what}: grad {i} differs by {(x - y).abs().max()}"


def same_on_all_ranks(tensors: list, what: str) -> None:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    for r, g in enumerate(gathered):
        assert torch.equal(g, gathered[0]), f"{what}: rank {r} differs from rank 0"


def sync_params(dst: nn.Module, src: nn.Module) -> None:
    with torch.no_grad():
        for a, b in zip(dst.parameters(), src.parameters(), strict=True):
            a.copy_(b)


# ---- checks: each takes (rank, ws) and raises on failure --------------------------------


def expect_error(kind: type, needles: list[str], build: Callable[[], object]) -> str:
    start = time.perf_counter()
    try:
        build()
    except kind as err:
        text = str(err)
        for needle in needles:
            assert needle in text, f"{needle!r} not in: {text}"
        assert time.perf_counter() - start < 10, "the error took too long"
        return text
    raise AssertionError(f"expected {kind.__name__} mentioning {needles}")


def check_matches_reference_and_ddp(rank: int, ws: int) -> None:
    base = mlp()
    ddp = DDP(copy.deepcopy(base))
    ours = gt.DataParallel(copy.deepcopy(base))
    view = gt.DataParallel(copy.deepcopy(base), gradient_as_bucket_view=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (base, ddp, ours, view)]
    for s in range(3):
        x, y = batch(s, ws)
        ref = reference_grads(base, x, y, ws)
        for m in (ddp, ours, view):
            step(m, x, y, rank)
        assert_tensors_close(grads(ours), ref, f"step {s} vs single process", **REF_TOL)
        assert_equal(grads(ours), grads(ddp), f"step {s} vs torch DDP")
        assert_equal(grads(view), grads(ours), f"step {s} gradient_as_bucket_view")
        for p, g in zip(base.parameters(), ref, strict=True):
            p.grad = g
        for opt in opts:
            opt.step()
    for p, q in zip(ours.parameters(), base.parameters(), strict=True):
        torch.testing.assert_close(p, q, **REF_TOL)
    assert_equal(list(ours.parameters()), list(ddp.parameters()), "parameters vs DDP")
    assert ours.bucket_plan.order == "observed"
    # Grads of the view mode live in its buckets, so no copy happens.
    buffers = {b.buffer.untyped_storage().data_ptr() for b in view.reducer.buckets}
    for p in view.parameters():
        assert p.grad.untyped_storage().data_ptr() in buffers


def check_many_buckets_match_ddp(rank: int, ws: int) -> None:
    """Small caps give several buckets; after the rebuild gradsync's layout is DDP's, so
    even 4-rank ring sums (whose order depends on a value's position) agree bitwise."""
    base = mlp(hidden=24)
    cap = 0.0005  # MiB: ~0.5 KiB buckets
    ddp = DDP(copy.deepcopy(base), bucket_cap_mb=cap)
    ours = gt.DataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
    assert len(ours.bucket_plan.buckets) > 2
    launches = _record_launches(ours)
    for s in range(3):
        sync_params(ddp.module, base)
        sync_params(ours.module, base)
        x, y = batch(s, ws)
        step(ddp, x, y, rank)
        launches.clear()
        step(ours, x, y, rank)
        if s == 2:  # per-bucket readiness: each bucket launched by its own flush hook
            assert launches == ["backward"] * len(ours.bucket_plan.buckets), launches
        assert_tensors_close(
            grads(ours), reference_grads(base, x, y, ws), f"step {s} vs reference", **REF_TOL
        )
        # Step 0: DDP starts with one bucket, gradsync with the capped layout.
        if s > 0 or ws <= 2:
            assert_equal(grads(ours), grads(ddp), f"step {s} vs torch DDP")
    same_on_all_ranks([p.grad for p in ours.parameters()], "gradients")


def _record_launches(model: gt.DataParallel) -> list[str]:
    """Per bucket launch, whether it ran during backward or at its end (the finalize)."""
    reducer, seen = model._reducer, []
    launch, finalize, at_end = reducer.collective.launch, reducer._finalize, [False]

    def record(bucket: object, *, is_last: bool) -> None:
        seen.append("end" if at_end[0] else "backward")
        launch(bucket, is_last=is_last)

    def end() -> None:
        at_end[0] = True
        try:
            finalize()
        finally:
            at_end[0] = False

    reducer.collective.launch, reducer._finalize = record, end
    return seen


def check_legacy_equals_overlap(rank: int, ws: int) -> None:
    base = mlp()
    for kwargs in ({}, {"reduce_dtype": torch.bfloat16}, {"reduce": "sum"}):
        overlap = gt.DataParallel(copy.deepcopy(base), **kwargs)
        legacy = gt.DataParallel(copy.deepcopy(base), overlap=False, **kwargs)
        assert legacy.bucket_plan.order == "legacy"
        for s in range(3):
            x, y = batch(s, ws)
            same_layout = overlap.bucket_plan.slots == legacy.bucket_plan.slots
            step(overlap, x, y, rank)
            step(legacy, x, y, rank)
            # Bitwise wherever the arithmetic is the same: two-term sums commute; at 4 ranks
            # the ring sums each value in an order set by its position in the bucket.
            if ws <= 2 or same_layout:
                assert_equal(grads(legacy), grads(overlap), f"{kwargs} step {s}")
            else:
                tol = BF16_TOL if kwargs.get("reduce_dtype") else REF_TOL
                assert_tensors_close(grads(legacy), grads(overlap), f"{kwargs} step {s}", **tol)


def check_no_sync_accumulates(rank: int, ws: int) -> None:
    base = mlp()
    micro = 3

    def run(model: nn.Module, style: str) -> list:
        model.zero_grad(set_to_none=True)
        for k in range(micro):
            x, y = batch(k, ws)
            last = k == micro - 1
            if style == "property":
                model.require_backward_grad_sync = last
                F.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
            elif style == "flush":  # every backward local, then an explicit sync
                with model.no_sync():
                    F.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
                if last:
                    model.sync_gradients()
            elif last:
                F.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
            else:
                with model.no_sync():
                    F.mse_loss(model(shard(x, rank)), shard(y, rank)).backward()
        if isinstance(model, gt.DataParallel) and not model.options.overlap:
            model.sync_gradients()
        return grads(model)

    ref = copy.deepcopy(base)
    for k in range(micro):
        x, y = batch(k, ws)
        (sum(F.mse_loss(ref(shard(x, r)), shard(y, r)) for r in range(ws)) / ws).backward()
    ddp = DDP(copy.deepcopy(base))
    expected = [run(ddp, "context") for _ in range(2)][-1]  # round 2: rebuilt buckets
    assert_tensors_close(expected, grads(ref), "DDP no_sync vs single process", **REF_TOL)
    cases = {
        "context": gt.DataParallel(copy.deepcopy(base)),
        "property": gt.DataParallel(copy.deepcopy(base)),
        "flush": gt.DataParallel(copy.deepcopy(base)),
        "view": gt.DataParallel(copy.deepcopy(base), gradient_as_bucket_view=True),
        "legacy": gt.DataParallel(copy.deepcopy(base), overlap=False),
    }
    for name, model in cases.items():
        for _ in range(2):  # the second round runs on the rebuilt layout
            got = run(model, name if name in ("property", "flush") else "context")
        if name in ("legacy", "flush") and ws > 2:  # other bucket layout (see above)
            assert_tensors_close(got, expected, name, **REF_TOL)
        else:
            assert_equal(got, expected, f"no_sync ({name}) vs DDP")
    assert cases["property"].require_backward_grad_sync


class Branchy(nn.Module):
    """``never`` gets no gradient anywhere; ``sometimes`` only where ``use`` is true."""

    def __init__(self, with_never: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 3)
        self.sometimes = nn.Linear(6, 3)
        if with_never:
            self.never = nn.Linear(6, 3)
        self.tail = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        h = self.body(x)
        if use:
            h = h + self.sometimes(x)
        return self.tail(h)


def check_unused_parameters(rank: int, ws: int) -> None:
    # Without ``never``, rank 0 has every gradient at step 0 while the others lack one:
    # only they wait for the used-map then.
    for with_never in (True, False):
        _unused_parameters(rank, ws, Branchy(with_never))


def _unused_parameters(rank: int, ws: int, base: nn.Module) -> None:
    ours = gt.DataParallel(copy.deepcopy(base))
    legacy = gt.DataParallel(copy.deepcopy(base), overlap=False)
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
    # Step 2 uses ``sometimes`` under no_sync only: its accumulated grad must still travel.
    plan = [(0, {0}), (1, set()), (2, {ws - 1})]
    for s, users in plan:
        x, y = batch(s, ws)
        ref = copy.deepcopy(base)
        loss = sum(F.mse_loss(ref(shard(x, r), r in users), shard(y, r)) for r in range(ws))
        (loss / ws).backward()
        if s == 2:
            xa, ya = batch(7, ws)
            ref_a = sum(F.mse_loss(ref(shard(xa, r), True), shard(ya, r)) for r in range(ws))
            (ref_a / ws).backward()
        for m in (ours, legacy, ddp):
            m.zero_grad(set_to_none=True)
            if s == 2:
                with m.no_sync():
                    F.mse_loss(m(shard(xa, rank), True), shard(ya, rank)).backward()
            F.mse_loss(m(shard(x, rank), rank in users), shard(y, rank)).backward()
            if m is legacy:
                m.sync_gradients()
        expected = {name: p.grad for name, p in ref.named_parameters()}
        for mode, m in (("overlap", ours), ("legacy", legacy)):
            for name, p in m.module.named_parameters():
                what = f"{mode} step {s} {name}"
                if expected[name] is None:  # no rank used it: None, as in one process
                    assert p.grad is None, what
                else:
                    torch.testing.assert_close(p.grad, expected[name], **REF_TOL, msg=what)
        if ws <= 2:  # DDP(find_unused_parameters=True) keeps its first layout
            assert_equal(
                [g for g in grads(ours) if g is not None],
                [g for g in grads(ddp) if g is not None],
                f"step {s} vs DDP",
            )
        same_on_all_ranks([g for g in grads(ours) if g is not None], f"step {s} gradients")


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.embed.weight
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.frozen(torch.tanh(self.mid(self.embed(tokens)))))


def check_tied_and_frozen(rank: int, ws: int) -> None:
    base = Tied()
    ours = gt.DataParallel(copy.deepcopy(base))
    ddp = DDP(copy.deepcopy(base))
    names = [slot.name for slot in ours.bucket_plan.slots]
    assert sorted(names) == ["embed.weight", "mid.bias", "mid.weight"], names
    for s in range(2):
        gen = torch.Generator().manual_seed(s)
        tokens = torch.randint(0, 11, (ws * N, 5), generator=gen)
        target = torch.randint(0, 11, (ws * N, 5), generator=gen)
        ref = copy.deepcopy(base)
        sum(
            F.cross_entropy(ref(shard(tokens, r)).flatten(0, 1), shard(target, r).flatten())
            for r in range(ws)
        ).div(ws).backward()
        for m in (ours, ddp):
            m.zero_grad(set_to_none=True)
            out = m(shard(tokens, rank)).flatten(0, 1)
            F.cross_entropy(out, shard(target, rank).flatten()).backward()
        assert_tensors_close(
            [g for g in grads(ours) if g is not None],
            [g for g in grads(ref) if g is not None],
            "tied",
            **REF_TOL,
        )
        assert_equal(grads(ours), grads(ddp), f"step {s} vs DDP")
        assert ours.module.frozen.weight.grad is None
    ours.module.frozen.weight.requires_grad_(True)
    try:
        ours(shard(tokens, rank))
    except RuntimeError as err:
        assert "'frozen.weight' was frozen" in str(err), err
    else:
        raise AssertionError("unfreezing after wrapping was not reported")
    # Wrap again, as the error says; the dropped wrapper's hooks must not sync as well.
    module = ours.module
    twin = gt.DataParallel(copy.deepcopy(module))
    del ours
    again = gt.DataParallel(module, reduce="sum")
    for m in (twin, again):
        m.zero_grad(set_to_none=True)
        F.cross_entropy(
            m(shard(tokens, rank)).flatten(0, 1), shard(target, rank).flatten()
        ).backward()
    assert again.module.frozen.weight.grad is not None
    expected = [None if g is None else g * ws for g in grads(twin)]  # frozen.bias: None
    assert_equal(grads(again), expected, "re-wrapped, reduce='sum'")


def check_compression(rank: int, ws: int) -> None:
    base = mlp()
    fp32 = gt.DataParallel(copy.deepcopy(base))
    wire = {
        dtype: gt.DataParallel(copy.deepcopy(base), reduce_dtype=dtype)
        for dtype in (torch.bfloat16, torch.float16)
    }
    # The gradients' own dtype on the wire: still a mean (it once summed, dividing nowhere).
    own_dtype = gt.DataParallel(copy.deepcopy(base), reduce_dtype=torch.float32)
    hooked = {name: gt.DataParallel(copy.deepcopy(base)) for name in ("bf16", "fp16", "ar")}
    hooked["bf16"].register_comm_hook(None, gt.bf16_compress_hook)
    hooked["fp16"].register_comm_hook(None, gt.fp16_compress_hook)
    hooked["ar"].register_comm_hook(None, gt.allreduce_hook)
    torch_bf16 = gt.DataParallel(copy.deepcopy(base))  # torch's own hook on our buckets
    torch_bf16.register_comm_hook(dist.group.WORLD, torch_hooks.bf16_compress_hook)
    ddp_fp16 = DDP(copy.deepcopy(base))  # DDP refuses its bf16 hook without CUDA
    ddp_fp16.register_comm_hook(dist.group.WORLD, torch_hooks.fp16_compress_hook)
    models = [fp32, own_dtype, *wire.values(), torch_bf16, ddp_fp16, *hooked.values()]
    for s in range(2):
        x, y = batch(s, ws)
        for m in models:
            sync_params(m.module, base)
            step(m, x, y, rank)
        bf16, fp16 = grads(wire[torch.bfloat16]), grads(wire[torch.float16])
        assert_equal(grads(hooked["ar"]), grads(fp32), "allreduce_hook vs no hook")
        assert_equal(grads(own_dtype), grads(fp32), "reduce_dtype=float32 vs None")
        assert_equal(grads(hooked["bf16"]), bf16, "bf16 hook vs reduce_dtype=bfloat16")
        assert_equal(grads(hooked["fp16"]), fp16, "fp16 hook vs reduce_dtype=float16")
        assert_equal(grads(torch_bf16), bf16, "torch's bf16 hook vs ours")
        assert_equal(grads(ddp_fp16), fp16, "DDP + fp16 hook vs reduce_dtype=float16")
        assert_tensors_close(bf16, grads(fp32), "bf16 wire vs fp32", **BF16_TOL)
        assert_tensors_close(fp16, grads(fp32), "fp16 wire vs fp32", **FP16_TOL)
        assert all(g.dtype == torch.float32 for g in bf16 + fp16)
    expect_error(
        RuntimeError,
        ["only once"],
        lambda: hooked["ar"].register_comm_hook(None, gt.allreduce_hook),
    )
    expect_error(
        RuntimeError,
        ["before the first backward"],
        lambda: fp32.register_comm_hook(None, gt.allreduce_hook),
    )
    expect_error(
        ValueError,
        ["reduce_dtype"],
        lambda: gt.DataParallel(mlp(), reduce_dtype=torch.bfloat16).register_comm_hook(
            None, gt.allreduce_hook
        ),
    )


def check_reduce_sum_and_groups(rank: int, ws: int) -> None:
    base = mlp()
    mean = gt.DataParallel(copy.deepcopy(base))
    total = gt.DataParallel(copy.deepcopy(base), reduce="sum")
    x, y = batch(0, ws)
    step(mean, x, y, rank)
    step(total, x, y, rank)
    # Dividing by a power of two is exact, so sum == world_size * mean bitwise.
    assert_equal(grads(total), [g * ws for g in grads(mean)], "sum vs mean")
    if ws < 4:
        return
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[rank // 2]
    ours = gt.DataParallel(mlp(seed=rank), process_group=group)
    ddp = DDP(mlp(seed=rank), process_group=group)
    assert_equal(list(ours.parameters()), list(ddp.parameters()), "broadcast in the pair")
    for s in range(2):
        step(ours, x, y, rank)
        step(ddp, x, y, rank)
        assert_equal(grads(ours), grads(ddp), f"pair group step {s} vs DDP")
    pair_ref = [p.detach().clone() for p in mlp(seed=rank - rank % 2).parameters()]
    assert_equal(list(ours.parameters()), pair_ref, "weights from the pair's first rank")
