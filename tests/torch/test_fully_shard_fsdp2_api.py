"""FSDP2's whole drop-in surface on gradsync's ``fully_shard`` (docs/torch-zero3.md, "Switching
from FSDP2"): the list form, the sharded modules as ``FSDPModule``s whose setters give FSDP2's
bits, a sentence for every other ``FSDPModule`` method, for sharding the root before its
blocks, and for an optimizer that reads whole tensors (Muon) on row shards.

The model is torchtitan's shape in small: an embedding, blocks, a norm and a head, sharded as
torchtitan shards it (each block, the embedding, ``[norm, output]`` as one unit, the root).
Each case trains FSDP2 and gradsync alike on 2 gloo ranks and compares every parameter shard,
gradient and optimizer state with ``torch.equal``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.support.asserts import assert_tensors_equal as _bitwise  # this file's names for them
from tests.support.harness import run_checks, run_workers
from tests.torch.fsdp_models import local_shards as _locals

STEPS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 5)  # 5 rows over 2 ranks: 3 + 2, padded
        self.out = nn.Linear(5, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.relu(self.fc(x)))


class Titan(nn.Module):
    """torchtitan's Transformer in small (``tied``: the head shares the embedding's weight)."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(11, 6)
        self.layers = nn.ModuleList([Block() for _ in range(3)])
        self.norm = nn.LayerNorm(6)
        self.output = nn.Linear(6, 11, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _titan(shard, *, tied: bool = False, **options) -> Titan:
    """Sharded as torchtitan's apply_fsdp does it: blocks, embedding, [norm, output], root."""
    torch.manual_seed(0)
    model = Titan(tied)
    for block in model.layers:
        shard(block, **options)
    if tied:  # FSDP2's own error for a weight shared across units recommends this list
        shard([model.tok_embeddings, model.output], **options)
    else:
        shard(model.tok_embeddings, **options)
        shard([model.norm, model.output], **options)
    shard(model, **options)
    return model


def _tokens(rank: int, step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    return torch.randint(0, 11, (2, 5), generator=g)


def _train(model, rank, *, setup=None, before=None, micro=1, optimizer=torch.optim.AdamW):
    """``setup(model)`` once, ``before(model, micro_step, last)`` before each backward."""
    if setup is not None:
        setup(model)
    opt = optimizer(model.parameters(), lr=0.01)
    for step in range(STEPS):
        for m in range(micro):
            if before is not None:
                before(model, m, m == micro - 1)
            model(_tokens(rank, step, m)).square().mean().backward()
        opt.step()
        if step < STEPS - 1:  # keep the last gradients to compare
            opt.zero_grad()
    for module in _fsdp_modules(model):  # a unit kept gathered registers its gathered tensors
        module.reshard()
    return _locals(model, opt)


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _each(method: str, *args, **kwargs):
    """torchtitan's loop: call ``method`` on every FSDPModule of the model."""

    def setup(model: nn.Module) -> None:
        for module in _fsdp_modules(model):
            getattr(module, method)(*args, **kwargs)

    return setup


def _both(*setups):
    def setup(model: nn.Module) -> None:
        for s in setups:
            s(model)

    return setup


def _deprecated_factor(model: nn.Module) -> None:
    for module in _fsdp_modules(model):
        with pytest.warns(DeprecationWarning):
            module.set_reduce_scatter_divide_factor(2.0)


def _accumulate(model: nn.Module, micro: int, last: bool) -> None:
    """FSDP2's gradient-accumulation recipe: no reduction and no reshard until the last."""
    model.set_requires_gradient_sync(last)
    model.set_reshard_after_backward(last)
    model.set_is_last_backward(last)


def _prefetch(model: nn.Module) -> None:
    """torchtitan's explicit prefetching (its _experimental_fsdp_prefetch)."""
    blocks = list(model.layers)
    model.tok_embeddings.set_modules_to_forward_prefetch([blocks[0]])
    for block, nxt in itertools.pairwise(blocks):
        block.set_modules_to_forward_prefetch([nxt])
    blocks[-1].set_modules_to_forward_prefetch([model.norm, model.output])
    model.output.set_modules_to_backward_prefetch([blocks[-1]])
    for block, prev in zip(blocks[1:], blocks, strict=False):
        block.set_modules_to_backward_prefetch([prev])
    blocks[0].set_modules_to_backward_prefetch([model.tok_embeddings])


def _unshard_first(model: nn.Module, micro: int, last: bool) -> None:
    handle = model.layers[0].unshard(async_op=True)
    assert handle is not None
    handle.wait()


def _partial_all_reduce(model: nn.Module, micro: int, last: bool) -> None:
    model.set_requires_all_reduce(last)  # HSDP: reduce-scatter every micro-step, all-reduce once


def _equal_to_fsdp2(rank: int, *, ours: dict, theirs: dict | None = None, **build):
    """A check: FSDP2 and gradsync trained alike (``theirs`` defaults to ``ours``) are bitwise
    equal, and have the same FSDPModules."""
    from torch.distributed.fsdp import fully_shard as fsdp2

    from gradsync_torch import fully_shard

    theirs = ours if theirs is None else theirs
    mesh = build.pop("mesh", None)

    def check() -> None:
        options = {} if mesh is None else {"mesh": mesh()}
        their_model = _titan(fsdp2, **build, **options)
        our_model = _titan(fully_shard, **build, **options)
        names = [n for n, m in their_model.named_modules() if m in _fsdp_modules(their_model)]
        ours_named = [n for n, m in our_model.named_modules() if m in _fsdp_modules(our_model)]
        assert names == ours_named, (names, ours_named)
        _bitwise(_train(their_model, rank, **theirs), _train(our_model, rank, **ours))

    return check


def _hsdp_2x1():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))


def _setters(rank: int, world_size: int) -> dict:
    # gloo has no ReduceOp.PREMUL_SUM, which FSDP2 uses for a divide factor other than the
    # shard group's size unless told to force sums; where FSDP2 cannot run a case on gloo,
    # its force-sum run is the reference (dividing by 1 or by a power of two is exact either
    # way, so the bits are the same).
    force = _each("set_force_sum_reduction_for_comms", True)
    cases = [
        ("the list form [norm, output]", _equal_to_fsdp2(rank, ours={})),
        ("the list form [embedding, tied head]", _equal_to_fsdp2(rank, ours={}, tied=True)),
        (
            "torchtitan's set_gradient_divide_factor(1.0) loop",
            _equal_to_fsdp2(
                rank,
                ours={"setup": _each("set_gradient_divide_factor", 1.0)},
                theirs={"setup": _both(_each("set_gradient_divide_factor", 1.0), force)},
            ),
        ),
        (
            "set_gradient_divide_factor(2.0)",
            _equal_to_fsdp2(rank, ours={"setup": _each("set_gradient_divide_factor", 2.0)}),
        ),
        (
            "set_gradient_divide_factor(3.0) with set_force_sum_reduction_for_comms",
            _equal_to_fsdp2(
                rank, ours={"setup": _both(_each("set_gradient_divide_factor", 3.0), force)}
            ),
        ),
        (
            "set_gradient_divide_factor(4.0) (PREMUL_SUM on gloo)",
            _equal_to_fsdp2(
                rank,
                ours={"setup": _each("set_gradient_divide_factor", 4.0)},
                theirs={"setup": _both(_each("set_gradient_divide_factor", 4.0), force)},
            ),
        ),
        ("set_force_sum_reduction_for_comms(True)", _equal_to_fsdp2(rank, ours={"setup": force})),
        (
            "set_reduce_scatter_divide_factor (deprecated)",
            _equal_to_fsdp2(rank, ours={"setup": _deprecated_factor}),
        ),
        (
            "accumulation: set_requires_gradient_sync, set_reshard_after_backward, "
            "set_is_last_backward",
            _equal_to_fsdp2(rank, ours={"before": _accumulate, "micro": 3}),
        ),
        (
            "set_modules_to_forward_prefetch, set_modules_to_backward_prefetch",
            _equal_to_fsdp2(rank, ours={"setup": _prefetch}),
        ),
        (
            "set_reshard_after_forward(False)",
            _equal_to_fsdp2(rank, ours={"setup": lambda m: m.set_reshard_after_forward(False)}),
        ),
        ("unshard(async_op=True)", _equal_to_fsdp2(rank, ours={"before": _unshard_first})),
        (
            "HSDP (2, 1): set_requires_all_reduce",
            _equal_to_fsdp2(rank, ours={"before": _partial_all_reduce, "micro": 3}, mesh=_hsdp_2x1),
        ),
        (
            "SGD with momentum",
            _equal_to_fsdp2(
                rank,
                ours={"optimizer": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9)},
            ),
        ),
        ("Adam", _equal_to_fsdp2(rank, ours={"optimizer": torch.optim.Adam})),
        ("a unit kept gathered across an optimizer step gathers again", lambda: _stale(rank)),
        ("the other FSDPModule methods raise a sentence", _unimplemented),
        ("sharding the root before its blocks", _root_first),
        ("a list unit must be inside a root", lambda: _list_alone(rank)),
        ("Muon is refused before its first step changes anything", lambda: _muon(rank)),
    ]
    return run_checks(cases)


def _stale(rank: int) -> None:
    """A unit still gathered (set_reshard_after_backward(False) through the optimizer step,
    where FSDP2 computes the next forward with the old gathered values) or still gathering
    (an unshard(async_op=True) issued before the step) when the optimizer changes its shards
    gathers them again: both runs equal the plain one."""
    from gradsync_torch import fully_shard

    def train(model: nn.Module, *, early: bool) -> dict:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        for step in range(STEPS):
            model(_tokens(rank, step, 0)).square().mean().backward()
            if early:  # an all-gather in flight across the step, finished by the next forward
                assert model.layers[1].unshard(async_op=True) is not None
            opt.step()
            opt.zero_grad()
        model(_tokens(rank, STEPS, 0)).square().mean().backward()
        return _locals(model, opt)

    plain = _train(_titan(fully_shard), rank)
    kept = _train(_titan(fully_shard), rank, setup=lambda m: m.set_reshard_after_backward(False))
    _bitwise(plain, kept)
    model = _titan(fully_shard)
    model.layers[1].unshard()
    model.layers[1].reshard()  # unshard/reshard by hand leave nothing behind
    _bitwise(train(_titan(fully_shard), early=False), train(model, early=True))


# What gradsync implements of FSDPModule's public methods; every other one raises a sentence.
IMPLEMENTED = {
    "reshard",
    "unshard",
    "set_is_last_backward",
    "set_requires_gradient_sync",
    "set_requires_all_reduce",
    "set_reshard_after_forward",
    "set_reshard_after_backward",
    "set_modules_to_forward_prefetch",
    "set_modules_to_backward_prefetch",
    "set_reduce_scatter_divide_factor",
    "set_gradient_divide_factor",
    "set_force_sum_reduction_for_comms",
}


def _unimplemented() -> None:
    """Every attribute FSDPModule defines is gradsync's own (none runs FSDP2's internals on a
    gradsync module, none is an AttributeError); the ones gradsync does not implement raise
    NotImplementedError naming themselves."""
    from torch.distributed.fsdp import FSDPModule

    from gradsync_torch import ShardedModule, fully_shard

    python = {"__module__", "__doc__", "__dict__", "__weakref__", "__annotations__"}
    python |= {"__qualname__", "__firstlineno__", "__static_attributes__"}
    theirs = set(vars(FSDPModule)) - python
    missing = sorted(theirs - set(vars(ShardedModule)))
    assert not missing, f"FSDPModule attributes gradsync inherits from FSDP2: {missing}"
    public = {n for n in dir(FSDPModule) if not n.startswith("_")}
    assert IMPLEMENTED <= public, IMPLEMENTED - public
    model = fully_shard(nn.Linear(4, 4))
    assert isinstance(model, FSDPModule) and isinstance(model, ShardedModule)
    assert model.float() is model  # nn.Module's _apply, not FSDP2's (which reads its state)
    sliced = fully_shard(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))[0:1]
    assert type(sliced) is nn.Sequential  # a sharded class builds its original, as FSDP2's
    for name in [*sorted(public - IMPLEMENTED), "_get_fsdp_state", "_set_unshard_async_op"]:
        with pytest.raises(NotImplementedError, match=rf"{name}\b.*gradsync") as error:
            getattr(model, name)()
        assert len(str(error.value).splitlines()) == 1, error.value
    with pytest.raises(ValueError, match=r"gradsync_torch\.fully_shard"):
        model.set_modules_to_forward_prefetch([nn.Linear(2, 2)])


def _root_first() -> None:
    from torch.distributed.fsdp import fully_shard as fsdp2

    from gradsync_torch import fully_shard

    model = Titan()
    fully_shard(model)
    with pytest.raises(ValueError, match=r"'layers\.0'|bottom-up") as error:
        fully_shard(model.layers[0])
    assert "each block first, then the root" in str(error.value), error.value
    theirs = Titan()
    fsdp2(theirs.layers[0])  # a parameter FSDP2 already sharded
    with pytest.raises(ValueError, match="already a DTensor"):
        fully_shard(theirs)


def _list_alone(rank: int) -> None:
    from gradsync_torch import fully_shard

    model = Titan()
    with pytest.raises(ValueError, match="at least one module"):
        fully_shard([])
    fully_shard([model.norm, model.output])  # and never the root
    with pytest.raises(ValueError, match=r"fully_shard\(\[LayerNorm, Linear\]\).*root"):
        model(_tokens(rank, 0, 0))
    with pytest.raises(ValueError, match="already applied"):
        fully_shard([model.layers[0], model.norm])


def _muon(rank: int) -> None:
    """torch.optim.Muon orthogonalizes each rank's rows, not the matrix: refused at its first
    step with ZeRO-2's sentence, before any parameter or state changes. Muon on a model
    gradsync did not shard, in the same process, still steps."""
    from gradsync_torch import fully_shard

    def mlp() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8, bias=False), nn.ReLU(), nn.Linear(8, 4, bias=False))

    model = mlp()
    fully_shard(model[0])
    fully_shard(model)
    for optimizer in (torch.optim.Muon, torch.optim.Adafactor):
        opt = optimizer(model.parameters(), lr=0.02)
        model(torch.randn(3, 6)).square().mean().backward()
        before = [p.to_local().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match=rf"elementwise.*{optimizer.__name__}") as error:
            opt.step()
        assert "fully_shard" in str(error.value), error.value
        assert all(
            torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters(), strict=False)
        )
        assert not opt.state, "the refused step created optimizer state"
        model.zero_grad()
    plain = mlp()
    opt = torch.optim.Muon(plain.parameters(), lr=0.02)
    plain(torch.randn(3, 6)).square().mean().backward()
    weight = plain[0].weight.detach().clone()
    opt.step()
    assert not torch.equal(weight, plain[0].weight)


@pytest.mark.slow
def test_fsdp2_surface():
    for results in run_workers(_setters, 2, timeout=300):
        failures = {name: error for name, error in results.items() if error is not None}
        assert not failures, "\n".join(f"{name}: {error}" for name, error in failures.items())


def test_implemented_names_are_fsdp2s():
    """The methods this file expects gradsync to implement are FSDP2's (a torch upgrade that
    adds one shows up in _unimplemented as a method gradsync must answer)."""
    from torch.distributed.fsdp import FSDPModule

    assert not dist.is_initialized()
    assert IMPLEMENTED <= {n for n in dir(FSDPModule) if not n.startswith("_")}
