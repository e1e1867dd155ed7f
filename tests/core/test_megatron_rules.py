"""Megatron-core's topology rules, as its ``initialize_model_parallel`` applies them (issue 22).

Each case runs megatron-core's own ``initialize_model_parallel`` on a fake process group of the
case's world size (no communication: torch's ``fake`` backend) and compares its outcome with
gradsync's ``Topology``: the same layouts accepted with the same groups, the same layouts refused,
the refused axis named and the order quoted as typed. ``ProcessGroups`` is built on the same fake
world and refuses what ``Topology`` refuses. Skipped, with the reason, where megatron-core is not
installed.
"""

from __future__ import annotations

import random
import re
import warnings

import pytest

from gradsync_core import EXPERT_GROUPS, Topology
from gradsync_core.plan._rank_generator import complete_order

pytestmark = pytest.mark.slow  # importing megatron-core alone takes seconds

dist = pytest.importorskip("torch.distributed")
fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")

# Megatron-core's names for gradsync's expert groups, asked of its expert generator.
EXPERT_NAMES = {"ep": "ep", "etp": "tp", "edp": "dp", "etp-ep": "tp-ep", "etp-ep-pp": "tp-ep-pp"}
# Megatron-core's getters for rank 0's groups after initialize_model_parallel.
RANK0_GETTERS = {
    "tp": "get_tensor_model_parallel_group",
    "pp": "get_pipeline_model_parallel_group",
    "dp": "get_data_parallel_group",
    "ep": "get_expert_model_parallel_group",
    "etp": "get_expert_tensor_parallel_group",
    "edp": "get_expert_data_parallel_group",
}

# (world_size, Topology.create keywords): the issue's cases and their neighbours.
CASES = {
    # pp is last in the order as typed; Megatron builds edp = 4 (dense dp = 2).
    "typed-pp-last-edp4": (16, {"tp": 2, "cp": 2, "pp": 2, "order": "tp-cp-dp-pp"}),
    # The same groups, but the typed order ends in 'ep': Megatron's pp-last rule refuses.
    "typed-ep-after-pp": (16, {"tp": 2, "cp": 2, "pp": 2, "order": "tp-cp-dp-pp-ep"}),
    # ep = 2 and the order has no 'ep': Megatron's expert generator refuses and names it.
    "ep-missing-pp2": (8, {"ep": 2, "pp": 2, "order": "tp-dp-pp"}),
    "ep-missing-pp1": (4, {"ep": 2, "order": "tp-dp"}),
    # Dense dp = 1 leaves 'dp' out legally, but the expert dp (edp) is 2.
    "edp-missing": (4, {"tp": 4, "etp": 1, "ep": 2, "order": "tp-ep-pp"}),
    "edp-missing-no-experts": (4, {"tp": 2, "cp": 2, "order": "tp-cp"}),
    "pp-first-edp-differs": (8, {"cp": 2, "pp": 2, "order": "pp-tp-cp-dp"}),
    "short-order-accepted": (8, {"tp": 2, "ep": 2, "order": "tp-ep-dp"}),
    "default-order-moe": (16, {"tp": 2, "ep": 4}),
    "etp1-pp-last": (16, {"tp": 2, "ep": 2, "etp": 1, "pp": 2, "order": "tp-ep-dp-pp"}),
}


@pytest.fixture(scope="module", name="parallel_state")
def _parallel_state():
    """megatron-core's ``parallel_state``, imported by the first test that needs it rather than
    at collection: megatron-core imports torch and probes for Apex and Transformer Engine,
    seconds that every pytest worker would pay for every run, ``-m "not slow"`` included."""
    with warnings.catch_warnings():  # megatron warns that Apex / Transformer Engine are absent
        warnings.simplefilter("ignore")
        return pytest.importorskip(
            "megatron.core.parallel_state", reason="megatron-core is not installed"
        )


@pytest.fixture
def fake_world(parallel_state):
    """Start a fake process group of a given size (rank 0); torn down after the test."""

    def start(world_size: int) -> None:
        store = fake_pg.FakeStore()
        dist.init_process_group("fake", store=store, rank=0, world_size=world_size)

    yield start
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _megatron_outcome(parallel_state, world_size: int, kwargs: dict) -> tuple[str | None, dict]:
    """(the error megatron-core raises or None, rank 0's groups by gradsync name)."""
    order = kwargs.get("order", "tp-cp-ep-dp-pp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=kwargs.get("tp", 1),
                pipeline_model_parallel_size=kwargs.get("pp", 1),
                context_parallel_size=kwargs.get("cp", 1),
                expert_model_parallel_size=kwargs.get("ep", 1),
                expert_tensor_parallel_size=kwargs.get("etp"),
                order=order,
                create_gloo_process_groups=False,
            )
        except (AssertionError, RuntimeError) as err:
            return str(err), {}
    groups = {}
    for name, getter in RANK0_GETTERS.items():
        group = getattr(parallel_state, getter)()
        groups[name] = tuple(dist.get_process_group_ranks(group))
    return None, groups


def _gradsync_outcome(world_size: int, kwargs: dict) -> tuple[str | None, Topology | None]:
    """(gradsync's error or None, the topology); expert groups are asked for, which is where
    a topology without experts applies the expert rules."""
    try:
        topo = Topology.create(world_size, **kwargs)
        for name in EXPERT_GROUPS:
            topo.groups(name)
    except ValueError as err:
        return str(err), None
    return None, topo


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_topology_accepts_and_refuses_what_megatron_does(case, fake_world, parallel_state):
    world_size, kwargs = case
    fake_world(world_size)
    theirs, rank0 = _megatron_outcome(parallel_state, world_size, kwargs)
    ours, topo = _gradsync_outcome(world_size, kwargs)
    typed = kwargs.get("order", "tp-cp-ep-dp-pp")
    if theirs is not None:
        assert ours is not None, f"megatron-core refuses ({theirs}); gradsync accepts"
        assert repr(typed) in ours, "the error must quote the order as typed"
        named = re.search(r"The size of \((\w+)\)", theirs)
        if named:  # megatron names the generator axis it lacks; so does gradsync
            assert f"leaves out [{named.group(1)!r}]" in ours, (theirs, ours)
        else:
            assert "put pp last" in ours, (theirs, ours)
        return
    assert ours is None, f"megatron-core accepts; gradsync refuses: {ours}"
    for name, ranks in rank0.items():
        assert topo.group_of(name, 0) == ranks, name
    # Every group, against megatron's generators built from the order as typed.
    expert = parallel_state.RankGenerator(
        tp=topo.etp, ep=topo.ep, dp=topo.edp, pp=topo.pp, cp=1, order=typed
    )
    dense = parallel_state.RankGenerator(
        tp=topo.tp, ep=1, dp=topo.dp, pp=topo.pp, cp=topo.cp, order=typed
    )
    for name, token in EXPERT_NAMES.items():
        assert topo.groups(name) == tuple(map(tuple, expert.get_ranks(token))), name
    for name in ("tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-pp"):
        assert topo.groups(name) == tuple(map(tuple, dense.get_ranks(name))), name
    # Read back from JSON (the completed order) it is still accepted, with the same groups.
    again = Topology.from_json(topo.to_json())
    assert again == topo and all(again.groups(n) == topo.groups(n) for n in EXPERT_NAMES)


def test_the_issue_case_builds_megatrons_expert_groups():
    topo = Topology.create(16, tp=2, cp=2, pp=2, order="tp-cp-dp-pp")
    assert (topo.dp, topo.edp) == (2, 4)
    assert topo.order == "tp-cp-dp-ep-pp"  # completed, still pp-last
    assert topo.groups("edp")[0] == (0, 2, 4, 6)


@pytest.mark.parametrize(
    ("order", "completed"),
    [
        ("tp-cp-dp-pp", "tp-cp-dp-ep-pp"),
        ("tp-dp", "tp-dp-cp-ep-pp"),
        ("pp-tp", "pp-tp-cp-ep-dp"),
        ("tp-cp-ep-dp-pp", "tp-cp-ep-dp-pp"),
    ],
    ids=["pp-last-stays-last", "no-pp", "pp-first", "full"],
)
def test_complete_order_keeps_pp_last_as_typed(order, completed):
    assert complete_order(order) == completed
    assert complete_order(completed) == completed


def test_errors_quote_the_order_as_typed():
    with pytest.raises(ValueError, match=r"refuses order 'tp-dp': order 'tp-dp' leaves out"):
        Topology.create(4, ep=2, order="tp-dp")
    topo = Topology.create(16, tp=2, cp=2, pp=2, order="tp-cp-dp-pp-ep")
    with pytest.raises(ValueError, match=r"order 'tp-cp-dp-pp-ep' does not end in 'pp'"):
        topo.groups("edp")


def test_process_groups_refuse_what_topology_refuses(fake_world):
    from gradsync_torch import ProcessGroups

    fake_world(16)
    refused = Topology.create(16, tp=2, cp=2, pp=2, order="tp-cp-dp-pp-ep")
    with pytest.raises(ValueError, match="does not end in 'pp'"):
        ProcessGroups(refused, names=("tp", "dp", "edp"))
    accepted = Topology.create(16, tp=2, cp=2, pp=2, order="tp-cp-dp-pp")
    groups = ProcessGroups(accepted, names=("tp", "dp", "edp", "etp-ep"))
    assert groups.ranks("edp") == (0, 2, 4, 6) and groups.ranks("dp") == (0, 4)
    with pytest.raises(ValueError, match="does not end in 'pp'"):
        ProcessGroups(refused).device_mesh(expert=True)


def _random_cases(count: int, seed: int) -> list[tuple[int, dict]]:
    """Random sizes with random orders that may leave out any axis, pp anywhere or nowhere."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        tp, cp, pp, etp, ep = (rng.choice((1, 1, 2, 2, 4)) for _ in range(5))
        world = tp * cp * pp * etp * ep * rng.choice((1, 2))
        if world > 64:
            continue
        tokens = [t for t in rng.sample(["tp", "cp", "ep", "dp", "pp"], 5) if rng.random() < 0.8]
        tokens = tokens or ["tp"]
        kwargs = {"tp": tp, "cp": cp, "pp": pp, "etp": etp, "ep": ep, "order": "-".join(tokens)}
        cases.append((world, kwargs))
    return cases


def test_random_layouts_have_megatrons_outcome(fake_world, parallel_state):
    accepted = refused = 0
    for world_size, kwargs in _random_cases(200, seed=22):
        fake_world(world_size)
        theirs, rank0 = _megatron_outcome(parallel_state, world_size, kwargs)
        ours, topo = _gradsync_outcome(world_size, kwargs)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        assert (theirs is None) == (ours is None), (world_size, kwargs, theirs, ours)
        if topo is not None:
            assert all(topo.group_of(n, 0) == r for n, r in rank0.items()), kwargs
            accepted += 1
        else:
            refused += 1
    assert accepted >= 40 and refused >= 40, (accepted, refused)
