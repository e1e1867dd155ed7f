"""Every dense and expert group against megatron-core's own RankGenerator (docs/model-parallel.md).

Skipped, with the reason, where megatron-core is not installed (it needs only torch; the
``test`` extra pins it). The hand-checked table in test_topology.py always runs.
"""

from __future__ import annotations

import random
import warnings

import pytest

from gradsync_core import EXPERT_GROUPS, STANDARD_GROUPS, Topology

pytestmark = pytest.mark.slow  # importing megatron-core alone takes seconds

# Megatron-core's names for gradsync's expert groups, asked of its expert generator.
EXPERT_NAMES = {"ep": "ep", "etp": "tp", "edp": "dp", "etp-ep": "tp-ep", "etp-ep-pp": "tp-ep-pp"}
DENSE_NAMES = [*(n for n in STANDARD_GROUPS if n != "ep"), "tp-dp", "cp-pp", "dp-pp"]
SIZES = (1, 1, 2, 2, 3, 4)


def _random_configs(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    configs = []
    while len(configs) < count:
        tp, cp, pp, etp, ep = (rng.choice(SIZES) for _ in range(5))
        world = tp * cp * pp * etp * ep * rng.choice((1, 2))
        order = rng.sample(["tp", "cp", "ep", "dp"], 4)
        order = [*order, "pp"] if rng.random() < 0.8 else ["pp", *order]
        configs.append(
            {
                "world_size": world,
                "tp": tp,
                "cp": cp,
                "pp": pp,
                "etp": etp,
                "ep": ep,
                "order": "-".join(order),
            }
        )
    return configs


def _megatron(parallel_state, topo: Topology):
    dense = parallel_state.RankGenerator(
        tp=topo.tp, ep=1, dp=topo.dp, pp=topo.pp, cp=topo.cp, order=topo.order, rank_offset=0
    )
    expert = parallel_state.RankGenerator(
        tp=topo.etp, ep=topo.ep, dp=topo.edp, pp=topo.pp, cp=1, order=topo.order, rank_offset=0
    )
    return dense, expert


def _as_tuples(groups) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(g) for g in groups)


CONFIGS = _random_configs(300, seed=15)


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


def test_every_dense_and_expert_group_matches_megatron_core(parallel_state):
    compared = refused = 0
    for config in CONFIGS:
        try:
            topo = Topology.create(**config)
            topo.groups("edp")
        except ValueError as err:
            # Refused for Megatron-core's reasons: its initialize_model_parallel asserts that
            # the pp-last rule holds and that both generators give the same pipeline groups.
            assert "put pp last" in str(err), (config, err)
            world, pp = config["world_size"], config["pp"]
            dp = world // (config["tp"] * config["cp"] * pp)
            edp = world // (config["etp"] * config["ep"] * pp)
            order = config["order"]
            dense = parallel_state.RankGenerator(config["tp"], 1, dp, pp, config["cp"], order)
            expert = parallel_state.RankGenerator(config["etp"], config["ep"], edp, pp, 1, order)
            pp_last = order.endswith("pp") or pp == 1
            assert (not pp_last and edp != dp) or dense.get_ranks("pp") != expert.get_ranks("pp"), (
                config
            )
            refused += 1
            continue
        dense, expert = _megatron(parallel_state, topo)
        for name in DENSE_NAMES:
            assert topo.groups(name) == _as_tuples(dense.get_ranks(name)), (config, name)
        for name, theirs in EXPERT_NAMES.items():
            assert topo.groups(name) == _as_tuples(expert.get_ranks(theirs)), (config, name)
        assert set(EXPERT_NAMES) == set(EXPERT_GROUPS)
        compared += 1
    assert compared >= 250 and compared + refused == len(CONFIGS)
