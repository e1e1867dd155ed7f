"""The cost model (docs/cost-model.md): profiles, closed forms of the timeline, the search.

Every timing test builds a machine whose figures make the answer a closed form: one bucket
and no overlap (compute then the whole collective), perfect overlap (only the last bucket
shows), a bandwidth-bound backward (the collectives queue), compute slowed beside a
collective, ZeRO-3 with and without overlap, HSDP's second level, and the pipeline's bubble
against ``simulate_pipeline`` and ``(m + p - 1)(f + b)``.
"""

import json
import math
from dataclasses import replace

import pytest

from gradsync_core import (
    ParamSpec,
    Topology,
    builtin_model,
    estimate_ddp,
    estimate_zero3,
    plan_buckets,
    plan_legacy_buckets,
    plan_param_shards,
    plan_pipeline,
    rebuild_buckets,
    simulate_pipeline,
)
from gradsync_core.plan import (
    COLLECTIVES,
    BlockTime,
    Configuration,
    LinkCost,
    MachineProfile,
    ModelProfile,
    bus_factor,
    configurations,
    estimate_model_profile,
    fit_link,
    median_profile,
    predict,
    predict_data_parallel,
    predict_pipeline,
    predict_zero3,
    profile_blocks,
    search_configurations,
)
from gradsync_core.plan.cost._pipeline_cost import phase_starts
from gradsync_core.plan.cost._timeline import _slowed

MIB = 1 << 20


def machine(latency=0.0, bandwidth=1e9, **extra):
    """Every collective at ``latency`` + factor * bytes / ``bandwidth``, any group size."""
    links = tuple(
        LinkCost(collective=c, group_size=None, latency_s=latency, bus_bandwidth=bandwidth)
        for c in COLLECTIVES
    )
    return MachineProfile(name="closed form", ranks_per_node=1 << 20, links=links, **extra)


def layers(n, rows=256, cols=1024):
    """``n`` blocks of one 1 MiB fp32 weight each: ``layers.i.weight``."""
    return [ParamSpec(name=f"layers.{i}.weight", shape=(rows, cols)) for i in range(n)]


def timed(blocks):
    """A measured profile of ``layers.i`` blocks with the ``(forward, backward)`` times given."""
    return ModelProfile(
        samples=8,
        source="measured",
        blocks=tuple(
            BlockTime(prefix=f"layers.{i}", forward_s=f, backward_s=b)
            for i, (f, b) in enumerate(blocks)
        ),
    )


def model(n, forward=1e-3, backward=2e-3, optimizer=0.0, activation=None, output=0):
    return ModelProfile(
        samples=8,
        source="given",
        optimizer_s=optimizer,
        blocks=tuple(
            BlockTime(
                prefix=f"layers.{i}",
                forward_s=forward,
                backward_s=backward,
                activation_bytes=activation,
                output_bytes=output,
            )
            for i in range(n)
        ),
    )


# -- the machine profile ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("collective", "n", "factor"),
    [
        ("all_reduce", 2, 1.0),
        ("all_reduce", 8, 1.75),
        ("all_gather", 4, 0.75),
        ("reduce_scatter", 8, 0.875),
        ("broadcast", 8, 1.0),
        ("p2p", 2, 1.0),
    ],
    ids=lambda v: str(v),
)
def test_bus_factors_are_nccl_tests(collective, n, factor):
    assert bus_factor(collective, n) == factor
    link = LinkCost(collective=collective, group_size=n, latency_s=1e-5, bus_bandwidth=2e9)
    assert link.time(4 * MIB, n) == pytest.approx(1e-5 + factor * 4 * MIB / 2e9)


def test_a_group_of_one_costs_nothing():
    assert machine(latency=1.0).time("all_reduce", MIB, 1) == 0.0


def test_fit_link_recovers_latency_and_bus_bandwidth():
    alpha, busbw, n = 3e-5, 5e9, 4
    samples = [(s, alpha + bus_factor("all_gather", n) * s / busbw) for s in (4096, MIB, 16 * MIB)]
    link = fit_link("all_gather", n, samples, issue=[(4096, 1e-5), (16 * MIB, 1e-5)])
    assert link.latency_s == pytest.approx(alpha)
    assert link.bus_bandwidth == pytest.approx(busbw)
    assert link.issue_time(MIB) == pytest.approx(1e-5)  # a constant issue cost stays constant


def test_fit_link_refuses_samples_without_a_bandwidth():
    with pytest.raises(ValueError, match="does not grow with the message size"):
        fit_link("all_reduce", 2, [(4096, 1e-3), (MIB, 1e-3)])


def test_a_piecewise_link_charges_each_range_its_own_bandwidth():
    # 1 MiB at 1 GB/s, the next 3 MiB at 0.5, the rest at 0.25; bus factor 1.75 over 8
    link = LinkCost(
        collective="all_reduce",
        group_size=8,
        latency_s=1e-4,
        bus_bandwidth=1e9,
        pieces=((MIB, 5e8), (4 * MIB, 2.5e8)),
    )
    assert link.time(MIB // 2, 8) == pytest.approx(1e-4 + 1.75 * (MIB / 2) / 1e9)
    assert link.time(MIB, 8) == pytest.approx(1e-4 + 1.75 * MIB / 1e9)
    assert link.time(2 * MIB, 8) == pytest.approx(1e-4 + 1.75 * (MIB / 1e9 + MIB / 5e8))
    wire = MIB / 1e9 + 3 * MIB / 5e8 + 4 * MIB / 2.5e8
    assert link.time(8 * MIB, 8) == pytest.approx(1e-4 + 1.75 * wire)
    assert link.time(8 * MIB, 1) == 0.0
    with pytest.raises(ValueError, match="increasing sizes above 0 bytes"):
        LinkCost(
            collective="p2p",
            group_size=2,
            latency_s=0,
            bus_bandwidth=1e9,
            pieces=((4 * MIB, 1e9), (MIB, 1e9)),
        )


def test_fit_link_piecewise_goes_through_every_measured_size():
    # XLA:CPU's shape: 16 MiB costs 30 times 1 MiB; one line misses the large sizes
    samples = [(16384, 1.6e-4), (MIB, 5.75e-4), (4 * MIB, 2.8e-3), (16 * MIB, 1.67e-2)]
    line = fit_link("all_reduce", 8, samples)
    assert line.time(16 * MIB, 8) < 0.7 * 1.67e-2  # the single line's under-charge
    curve = fit_link("all_reduce", 8, samples, piecewise=True)
    for nbytes, seconds in samples:
        assert curve.time(nbytes, 8) == pytest.approx(seconds)
    assert curve.time(8 * MIB, 8) == pytest.approx(2.8e-3 + (1.67e-2 - 2.8e-3) / 3)
    assert curve.time(32 * MIB, 8) == pytest.approx(1.67e-2 + (1.67e-2 - 2.8e-3) * 4 / 3)
    # a size no slower than a smaller one (noise at the latency floor) is left out, and an
    # intercept below 0 puts the first range's line through the origin
    noisy = [(MIB, 1e-3), (2 * MIB, 0.9e-3), (4 * MIB, 5e-3)]
    curve = fit_link("p2p", 2, noisy, piecewise=True)
    assert curve.latency_s == 0.0 and curve.pieces[0][0] == MIB
    assert curve.time(MIB // 2, 2) == pytest.approx(0.5e-3)
    assert curve.time(2 * MIB, 2) == pytest.approx(1e-3 + 4e-3 / 3)
    assert curve.time(4 * MIB, 2) == pytest.approx(5e-3)


def test_pieces_round_trip_and_a_version_3_profile_loads_without_them():
    pieces = ((MIB, 5e8), (4 * MIB, 2.5e8))
    links = (
        LinkCost(
            collective="all_reduce", group_size=8, latency_s=1e-4, bus_bandwidth=1e9, pieces=pieces
        ),
    )
    m = MachineProfile(name="piecewise", ranks_per_node=8, links=links)
    assert m.to_json()["version"] == 6
    assert MachineProfile.from_json(json.loads(json.dumps(m.to_json()))) == m
    assert m.time("all_reduce", 8 * MIB, 8) == links[0].time(8 * MIB, 8)
    posted = replace(m, post_s={"send": 2e-4, "receive": 1e-4})
    assert MachineProfile.from_json(json.loads(json.dumps(posted.to_json()))) == posted
    assert posted.post_time("send") == 2e-4 and m.post_time("receive") == 0.0
    with pytest.raises(ValueError, match="version-3 machine profile has the unknown key 'post_s'"):
        MachineProfile.from_json(posted.to_json() | {"version": 3})
    old = m.to_json() | {"version": 3}
    with pytest.raises(ValueError, match="version-3 machine profile link has the unknown key"):
        MachineProfile.from_json(old)
    old["links"] = [{k: v for k, v in old["links"][0].items() if k != "pieces"}]
    loaded = MachineProfile.from_json(old)
    assert loaded.link("all_reduce", 8).pieces == ()
    assert loaded.time("all_reduce", 8 * MIB, 8) == pytest.approx(1e-4 + 1.75 * 8 * MIB / 1e9)
    bad = m.to_json()
    bad["links"][0]["pieces"] = [{"from_bytes": MIB}]
    with pytest.raises(ValueError, match="a link's piece lacks the key 'bus_bandwidth'"):
        MachineProfile.from_json(bad)


def test_machine_profile_json_round_trip_and_lookup():
    m = MachineProfile(
        name="two levels",
        ranks_per_node=8,
        links=(
            LinkCost(collective="all_reduce", group_size=8, latency_s=1e-5, bus_bandwidth=4e11),
            LinkCost(
                collective="all_reduce",
                group_size=None,
                level="network",
                latency_s=3e-5,
                bus_bandwidth=4e10,
            ),
        ),
        copy_bandwidth=1e12,
        overlap_slowdown=1.1,
    )
    assert MachineProfile.from_json(json.loads(json.dumps(m.to_json()))) == m
    assert m.level_of([0, 7]) == "node" and m.level_of([0, 8]) == "network"
    assert m.link("all_reduce", 16, "network").bus_bandwidth == 4e10
    with pytest.raises(ValueError, match="no all_reduce cost for groups of 4 ranks within a node"):
        m.time("all_reduce", MIB, 4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kind": "plan"}, "expected kind 'machine_profile'"),
        ({"version": 9}, "reads version 1 or 2 or 3"),
        ({"colour": 1}, "unknown key 'colour'"),
        ({"links": []}, "non-empty list"),
        ({"overlap_slowdown": 0.5}, "overlap_slowdown must be >= 1"),
        ({"host_s": {"all_reduce": -1e-3}}, r"host_s\['all_reduce'\] must be a finite number"),
        ({"host_s": {"allreduce": 1e-3}}, "host_s has the unknown key 'allreduce'"),
        ({"step_host_s": {"ddp": 1e-3}}, "step_host_s has the unknown key 'ddp'"),
        ({"collective_scratch": {"p2p": -1}}, "must be a finite number >= 0"),
        ({"version": 1, "host_s": {"all_reduce": 1e-3}}, "version-1 .* unknown key 'host_s'"),
        ({"overlap_slowdowns": {"all_gather": 0.5}}, r"overlap_slowdowns\['all_gather'\] must"),
        ({"overlap_slowdowns": {"gather": 2.0}}, "overlap_slowdowns has the unknown key 'gather'"),
        ({"version": 2, "overlap_slowdowns": {}}, "version-2 .* unknown key 'overlap_slowdowns'"),
    ],
    ids=[
        "kind",
        "version",
        "unknown key",
        "no links",
        "speed-up",
        "negative host",
        "host kind",
        "step path",
        "negative scratch",
        "host in v1",
        "kind speed-up",
        "slowdown kind",
        "slowdowns in v2",
    ],
)
def test_machine_profile_refuses_bad_json(change, message):
    good = machine().to_json()
    with pytest.raises(ValueError, match=message):
        MachineProfile.from_json(good | change)


def test_host_overheads_round_trip_and_a_version_1_profile_loads_without_them():
    m = machine(
        latency=1e-4,
        host_s={"all_reduce": 2e-4},
        step_host_s={"zero3": 1e-3},
        collective_scratch={"all_gather": 1.0},
    )
    assert m.to_json()["version"] == 6
    assert MachineProfile.from_json(json.loads(json.dumps(m.to_json()))) == m
    assert m.issue_time("all_reduce", MIB, 2) == 2e-4  # the link's issue cost is 0 here
    assert m.issue_time("all_gather", MIB, 2) == 0.0
    assert m.issue_time("all_reduce", MIB, 1) == 0.0  # a group of one issues nothing
    assert m.step_host_time("zero3") == 1e-3 and m.step_host_time("data_parallel") == 0.0
    assert m.scratch_bytes("all_gather", MIB) == MIB and m.scratch_bytes("all_reduce", MIB) == 0
    new = ("host_s", "step_host_s", "collective_scratch")
    old = {k: v for k, v in m.to_json().items() if k not in new}
    loaded = MachineProfile.from_json(old | {"version": 1})
    assert loaded.host_s == {} and loaded.step_host_s == {} and loaded.collective_scratch == {}
    assert loaded.issue_time("all_reduce", MIB, 2) == 0.0


def test_slowdown_per_collective_kind_round_trips_and_a_version_2_profile_loads_without():
    m = machine(overlap_slowdown=2.0, overlap_slowdowns={"all_gather": 1000.0})
    assert MachineProfile.from_json(json.loads(json.dumps(m.to_json()))) == m
    assert m.slowdown("all_gather") == 1000.0 and m.slowdown("all_reduce") == 2.0
    old = {k: v for k, v in m.to_json().items() if k != "overlap_slowdowns"}
    loaded = MachineProfile.from_json(old | {"version": 2})
    assert loaded.overlap_slowdowns == {} and loaded.slowdown("all_gather") == 2.0


def test_pack_curves_round_trip_interpolate_and_a_version_4_profile_loads_without():
    curve = ((MIB, 1e-3), (4 * MIB, 4e-3), (8 * MIB, 12e-3))
    m = machine(pack_s={"all_reduce": curve})
    assert MachineProfile.from_json(json.loads(json.dumps(m.to_json()))) == m
    assert m.pack_time("all_reduce", MIB // 2) == pytest.approx(0.5e-3)  # proportional below
    assert m.pack_time("all_reduce", 2 * MIB) == pytest.approx(2e-3)  # linear between
    assert m.pack_time("all_reduce", 6 * MIB) == pytest.approx(8e-3)
    assert m.pack_time("all_reduce", 16 * MIB) == pytest.approx(28e-3)  # the last slope above
    assert m.pack_time("reduce_scatter", MIB) is None  # no curve: the caller copies
    with pytest.raises(ValueError, match="version-4 machine profile has the unknown key 'pack_s'"):
        MachineProfile.from_json(m.to_json() | {"version": 4})
    old = {k: v for k, v in m.to_json().items() if k != "pack_s"} | {"version": 4}
    assert MachineProfile.from_json(old).pack_s == {}
    with pytest.raises(ValueError, match="increasing sizes above 0 bytes"):
        machine(pack_s={"all_reduce": ((4 * MIB, 1e-3), (MIB, 2e-3))})
    with pytest.raises(ValueError, match="pack_s has the unknown key 'gather'"):
        machine(pack_s={"gather": ((MIB, 1e-3),)})


def test_jax_all_reduces_a_bucket_as_its_gradients_with_no_copies_and_combines_the_buckets():
    """JAX without overlap: ``synced`` all-reduces a bucket as a psum of its gradients (no
    copies, and an ``all_reduce`` packing curve, which calibrate once wrote, is not read), and
    XLA combines the buckets' all-reduces into one (one latency); torch copies each bucket in
    and out and all-reduces each."""
    specs = layers(4)
    m = machine(latency=1e-4, copy_bandwidth=MIB / 1e-3, pack_s={"all_reduce": ((4 * MIB, 7e-3),)})
    one = plan_buckets(specs, cap_bytes=64 * MIB)  # the four weights in one bucket
    apart = plan_buckets(specs, cap_bytes=MIB)  # a bucket each
    wire = 1e-4 + 4 * MIB / 1e9  # all-reduce over 2: factor 1
    args = {"machine": m, "model": model(4), "topology": Topology.create(2), "overlap": False}
    compute = 4 * 1e-3 + 4 * 2e-3
    for plan in (one, apart):
        jax = predict_data_parallel(specs, plan, executor="jax", **args)
        assert jax.step_s == pytest.approx(compute + wire)  # each gradient as it is, combined
        assert [(c.what, c.nbytes) for c in jax.comms] == [("buckets (combined)", 4 * MIB)]
    torch = predict_data_parallel(specs, one, **args)  # torch copies in and out
    assert torch.step_s == pytest.approx(compute + 2 * 4e-3 + wire)
    torch_apart = predict_data_parallel(specs, apart, **args)  # and all-reduces each bucket
    assert torch_apart.step_s == pytest.approx(compute + 2 * 4e-3 + wire + 3e-4)
    with pytest.raises(ValueError, match="executor must be 'torch' or 'jax'"):
        predict_data_parallel(specs, one, executor="tf", **args)


def test_jax_zero2_packs_at_the_reduce_scatters_curve_without_copies():
    specs = layers(4)
    m = machine(copy_bandwidth=MIB / 1e-3, pack_s={"reduce_scatter": ((4 * MIB, 5e-3),)})
    p = predict(
        specs,
        Configuration(zero=2, bucket_cap_mb=25, overlap=False, param_sync="all_gather"),
        world_size=2,
        machine=m,
        model=model(4),
        executor="jax",
    )
    wire = 0.5 * 4 * MIB / 1e9  # reduce-scatter, then all-gather, over 2: factor 1/2 each
    apply = 1.5 * 4e-3  # the gathered updates added to every parameter: 1.5 copies of 4 MiB
    assert p.step_s == pytest.approx(4 * 1e-3 + 4 * 2e-3 + 5e-3 + 2 * wire + apply)
    bare = predict(  # a profile without the curve: the copies, as torch's (in, out, gathered)
        specs,
        p.configuration,
        world_size=2,
        machine=replace(m, pack_s={}),
        model=model(4),
        executor="jax",
    )
    copies = 4e-3 + 2e-3 + 4e-3
    assert bare.step_s == pytest.approx(4 * 1e-3 + 4 * 2e-3 + copies + 2 * wire + apply)


def test_zero2_buckets_reduce_scatter_at_their_own_link_on_torch_and_the_plain_one_on_jax():
    """torch's executor reduce-scatters ZeRO-2's buckets its own way (``reduce_scatter_into``),
    costed at ``bucket_reduce_scatter``'s entries; XLA's is the plain ``reduce_scatter``; a
    profile without the bucket kind costs it as ``reduce_scatter`` (its link, slowdown, host
    time and scratch)."""
    plain = tuple(
        LinkCost(collective=c, group_size=None, latency_s=0.0, bus_bandwidth=1e9)
        for c in COLLECTIVES
        if c != "bucket_reduce_scatter"
    )
    tables = {
        "overlap_slowdowns": {"reduce_scatter": 3.0},
        "host_s": {"reduce_scatter": 1e-4},
        "collective_scratch": {"reduce_scatter": 1.0},
    }
    old = MachineProfile(name="without", ranks_per_node=8, links=plain, **tables)
    kind = "bucket_reduce_scatter"
    assert old.time(kind, MIB, 2) == old.time("reduce_scatter", MIB, 2)
    assert (old.slowdown(kind), old.issue_time(kind, MIB, 2)) == (3.0, 1e-4)
    assert old.scratch_bytes(kind, MIB) == MIB
    own = LinkCost(collective=kind, group_size=None, latency_s=0.0, bus_bandwidth=4e9)
    new = replace(old, links=(*plain, own), overlap_slowdowns={kind: 2.0, "reduce_scatter": 3.0})
    assert new.time(kind, MIB, 2) == pytest.approx(old.time("reduce_scatter", MIB, 2) / 4)
    assert new.slowdown(kind) == 2.0 and new.slowdown("reduce_scatter") == 3.0
    assert MachineProfile.from_json(json.loads(json.dumps(new.to_json()))) == new
    config = Configuration(zero=2, bucket_cap_mb=25, overlap=False)
    args = {"world_size": 2, "machine": new, "model": model(4)}
    torch = predict(layers(4), config, **args)
    jax = predict(layers(4), config, executor="jax", **args)
    scatter = {e.collective: e.end_s - e.start_s for e in torch.cost.comms}
    assert scatter == {kind: pytest.approx(0.5 * 4 * MIB / 4e9), "broadcast": scatter["broadcast"]}
    assert "reduce_scatter" in {e.collective for e in jax.cost.comms}
    assert kind not in {e.collective for e in jax.cost.comms}


def test_the_documented_example_profiles_load():
    for name in ("h100-nvlink-node", "infiniband-cluster"):
        m = MachineProfile.load(f"examples/machine-profiles/{name}.json")
        assert m.time("all_reduce", 256 * MIB, 8) > 0
        assert m.source


# -- the model profile --------------------------------------------------------------------


def test_block_of_takes_the_longest_prefix_and_refuses_an_orphan():
    p = ModelProfile(
        samples=1,
        source="given",
        blocks=(
            BlockTime(prefix="", forward_s=0, backward_s=0),
            BlockTime(prefix="h.1", forward_s=0, backward_s=0),
        ),
    )
    assert p.block_of("h.1.fc.weight") == 1 and p.block_of("h.10.fc.weight") == 0
    with pytest.raises(ValueError, match="in no block"):
        ModelProfile(
            samples=1, source="given", blocks=(BlockTime(prefix="h.1", forward_s=0, backward_s=0),)
        ).block_of("wte.weight")


def test_model_profile_json_round_trip_and_scaling():
    p = model(3, activation=1000, output=10)
    assert ModelProfile.from_json(json.loads(json.dumps(p.to_json()))) == p
    half = p.scaled(4)
    assert half.forward_s == pytest.approx(p.forward_s / 2)
    assert half.activation_bytes == p.activation_bytes // 2


def test_median_profile_keeps_the_median_total_split_by_block_medians():
    runs = [model(2, forward=f) for f in (1.0, 5.0, 2.0)]
    merged = median_profile(runs)
    assert merged.forward_s == pytest.approx(4.0)  # the median run's total, 2 + 2
    assert merged.blocks[0].forward_s == pytest.approx(2.0)


def test_profile_blocks_are_the_pipeline_stages_modules():
    specs = builtin_model("gpt2-small")
    blocks = profile_blocks(specs)
    assert blocks[:3] == ["transformer.wte", "transformer.wpe", "transformer.h.0"]
    assert blocks[-2:] == ["transformer.h.11", "transformer.ln_f"]
    stages = plan_pipeline(schedule="1F1B", microbatches=2, topology=Topology(pp=2), specs=specs)
    assert [m for s in stages.stages for m in s.modules] == blocks


def test_flop_estimate_is_six_n_d_and_says_so():
    specs = layers(2)
    p = estimate_model_profile(specs, tokens=100, flops_per_s=1e12)
    n = 256 * 1024
    assert p.source == "flops" and p.forward_s + p.backward_s == pytest.approx(
        2 * 6 * n * 100 / 1e12
    )
    cost = predict_data_parallel(
        specs, plan_buckets(specs), machine=machine(), model=p, topology=Topology.create(2)
    )
    assert any("FLOP estimate" in note for note in cost.notes)


# -- data parallelism: closed forms -------------------------------------------------------


def test_one_bucket_no_overlap_is_compute_then_the_collective():
    specs, m = layers(4), machine(latency=1e-4, bandwidth=1e9)
    buckets = plan_buckets(specs, cap_bytes=64 * MIB)
    assert len(buckets.buckets) == 1
    cost = predict_data_parallel(
        specs,
        buckets,
        machine=m,
        model=model(4, optimizer=5e-3),
        topology=Topology.create(4),
        overlap=False,
    )
    collective = 1e-4 + 1.5 * 4 * MIB / 1e9  # all-reduce over 4: 2(n-1)/n
    assert cost.step_s == pytest.approx(4 * 1e-3 + 4 * 2e-3 + collective + 5e-3)
    assert cost.exposed_comm_s == pytest.approx(collective)
    assert [c.collective for c in cost.comms] == ["all_reduce"]


def test_perfect_overlap_leaves_only_the_last_bucket():
    specs = layers(4)
    buckets = plan_buckets(specs, cap_bytes=MIB)  # one bucket per block, the last block first
    assert len(buckets.buckets) == 4
    m = machine(bandwidth=4e9)  # 1 MiB in 0.26 ms < a block's 2 ms backward
    cost = predict_data_parallel(
        specs, buckets, machine=m, model=model(4), topology=Topology.create(2)
    )
    last = MIB / 4e9
    assert cost.step_s == pytest.approx(4e-3 + 8e-3 + last)
    assert [round(c.exposed_s, 9) for c in cost.comms] == [0, 0, 0, round(last, 9)]


def test_bandwidth_bound_buckets_queue_behind_each_other():
    specs = layers(4)
    m = machine(bandwidth=MIB / 5e-3)  # 5 ms per bucket > 2 ms of backward per block
    cost = predict_data_parallel(
        specs,
        plan_buckets(specs, cap_bytes=MIB),
        machine=m,
        model=model(4),
        topology=Topology.create(2),
    )
    # the first bucket is ready after one block's backward; then four collectives in a row
    assert cost.step_s == pytest.approx(4e-3 + 2e-3 + 4 * 5e-3)


def test_compute_beside_a_collective_runs_slower():
    specs = layers(2)
    m = machine(bandwidth=MIB / 2e-3, overlap_slowdown=2.0)  # a bucket takes a block's backward
    cost = predict_data_parallel(
        specs,
        plan_buckets(specs, cap_bytes=MIB),
        machine=m,
        model=model(2),
        topology=Topology.create(2),
    )
    # block 0's 2 ms backward beside bucket 0: 1 ms of it in 2 ms, the rest alone; then bucket 1
    assert cost.step_s == pytest.approx(2e-3 + 2e-3 + 2e-3 + 1e-3 + 2e-3)


@pytest.mark.parametrize(
    ("slowdowns", "beside"),
    [
        ({}, 2e-3),  # a kind not listed: overlap_slowdown, 2 (the closed form above)
        ({"all_gather": 8.0}, 2e-3),  # another kind's figure changes nothing
        ({"all_reduce": 4.0}, 2e-3 + 1.5e-3),  # 0.5 ms of block 0 in 2 ms, 1.5 ms alone
        ({"all_reduce": 1000.0}, 2e-3 + 2e-3 * (1 - 1e-3)),  # compute waits: their sum
    ],
    ids=["default", "other kind", "four", "no overlap"],
)
def test_compute_beside_a_collective_runs_slower_by_its_kinds_figure(slowdowns, beside):
    specs = layers(2)
    m = machine(bandwidth=MIB / 2e-3, overlap_slowdown=2.0, overlap_slowdowns=slowdowns)
    cost = predict_data_parallel(
        specs,
        plan_buckets(specs, cap_bytes=MIB),
        machine=m,
        model=model(2),
        topology=Topology.create(2),
    )
    if not slowdowns or "all_reduce" not in slowdowns:
        beside = 2e-3 + 1e-3
    # forward, block 1's backward, block 0's backward beside bucket 0, then bucket 1
    assert cost.step_s == pytest.approx(2e-3 + 2e-3 + beside + 2e-3)


def test_the_largest_slowdown_in_flight_counts():
    flight = [(0.0, 2.0, 2.0), (1.0, 3.0, 4.0), (5.0, 6.0, 1.0)]
    assert _slowed(flight) == [(0.0, 1.0, 2.0), (1.0, 3.0, 4.0)]


def test_copies_and_issue_costs_run_on_the_compute_stream():
    specs = layers(1)
    link = LinkCost(
        collective="all_reduce", group_size=None, latency_s=0.0, bus_bandwidth=1e9, issue_s=1e-3
    )
    m = MachineProfile(name="copies", ranks_per_node=8, links=(link,), copy_bandwidth=MIB / 1e-3)
    cost = predict_data_parallel(
        specs, plan_buckets(specs), machine=m, model=model(1), topology=Topology.create(2)
    )
    # forward, backward, copy in (1 ms), issue (1 ms), the all-reduce, copy out (1 ms)
    assert cost.step_s == pytest.approx(1e-3 + 2e-3 + 1e-3 + 1e-3 + MIB / 1e9 + 1e-3)


def test_host_overhead_without_overlap_adds_n_times_h_and_the_steps_bookkeeping_once():
    specs, h, sync = layers(4), 3e-4, 1e-3
    buckets = plan_buckets(specs, cap_bytes=MIB)  # 4 buckets
    kwargs = dict(model=model(4), topology=Topology.create(2), overlap=False)
    base = predict_data_parallel(specs, buckets, machine=machine(latency=1e-4), **kwargs)
    hosted = machine(latency=1e-4, host_s={"all_reduce": h}, step_host_s={"data_parallel": sync})
    cost = predict_data_parallel(specs, buckets, machine=hosted, **kwargs)
    assert cost.step_s == pytest.approx(base.step_s + 4 * h + sync)
    assert cost.compute_s == pytest.approx(base.compute_s + 4 * h + sync)  # on the compute stream
    assert cost.exposed_comm_s == pytest.approx(base.exposed_comm_s)


def test_host_overhead_delays_compute_where_the_wire_time_overlaps():
    specs = layers(4)
    buckets = plan_buckets(specs, cap_bytes=MIB)  # one bucket per block, the last block first
    kwargs = dict(model=model(4), topology=Topology.create(2))
    wire = MIB / 4e9  # 0.26 ms: hidden behind the next block's 2 ms backward
    base = predict_data_parallel(specs, buckets, machine=machine(bandwidth=4e9), **kwargs)
    assert base.step_s == pytest.approx(4e-3 + 8e-3 + wire)
    slower_wire = machine(latency=1e-3, bandwidth=4e9)  # 1 ms more wire: still hidden but the last
    assert predict_data_parallel(specs, buckets, machine=slower_wire, **kwargs).step_s == (
        pytest.approx(base.step_s + 1e-3)
    )
    h = 1e-3  # 1 ms of host work per bucket: every bucket's delays the next block
    hosted = machine(bandwidth=4e9, host_s={"all_reduce": h})
    cost = predict_data_parallel(specs, buckets, machine=hosted, **kwargs)
    assert cost.step_s == pytest.approx(base.step_s + 4 * h)
    assert cost.compute_s == pytest.approx(12e-3 + 4 * h)
    sync = machine(bandwidth=4e9, step_host_s={"data_parallel": 2e-3})  # once, after the wire
    assert predict_data_parallel(specs, buckets, machine=sync, **kwargs).step_s == pytest.approx(
        base.step_s + 2e-3
    )


def test_zero1_broadcasts_each_owners_parameters_after_its_step():
    specs = layers(2)
    p = predict(
        specs,
        Configuration(zero=1, bucket_cap_mb=64),
        world_size=2,
        machine=machine(),
        model=model(2, optimizer=4e-3),
    )
    kinds = [c.collective for c in p.cost.comms]
    assert kinds == ["all_reduce", "broadcast", "broadcast"]
    assert p.cost.ranks[0].memory.optimizer_state_bytes == 8 * 256 * 1024  # one weight of Adam


# -- ZeRO-3 and HSDP ----------------------------------------------------------------------


def test_zero3_without_overlap_waits_for_every_collective():
    n, units = 4, 3
    specs = layers(units)
    plan = plan_param_shards(specs, world_size=n, units=[f"layers.{i}" for i in range(units)])
    m = machine(latency=1e-4, bandwidth=1e9)
    ag, rs = m.time("all_gather", MIB, n), m.time("reduce_scatter", MIB, n)
    for reshard, gathers in ((True, 2), (False, 1)):
        cost = predict_zero3(
            plan,
            machine=m,
            model=model(units),
            topology=Topology.create(n),
            overlap=False,
            reshard_after_forward=reshard,
        )
        assert cost.step_s == pytest.approx(units * (gathers * ag + rs + 3e-3)), reshard


def test_zero3_host_overhead_per_gather_and_reduce_scatter_and_the_checks_once():
    n, units, h_ag, h_rs, sync = 4, 3, 2e-4, 5e-4, 1e-3
    specs = layers(units)
    plan = plan_param_shards(specs, world_size=n, units=[f"layers.{i}" for i in range(units)])
    m = machine(
        latency=1e-4,
        bandwidth=1e9,
        host_s={"all_gather": h_ag, "reduce_scatter": h_rs},
        step_host_s={"zero3": sync},
    )
    ag, rs = m.time("all_gather", MIB, n), m.time("reduce_scatter", MIB, n)
    for reshard, gathers in ((True, 2), (False, 1)):
        cost = predict_zero3(
            plan,
            machine=m,
            model=model(units),
            topology=Topology.create(n),
            overlap=False,
            reshard_after_forward=reshard,
        )
        per_unit = gathers * (h_ag + ag) + h_rs + rs + 3e-3
        assert cost.step_s == pytest.approx(units * per_unit + sync), reshard


def test_zero3_with_overlap_hides_all_but_the_first_gather_and_the_last_reduce():
    n, units = 2, 4
    specs = layers(units)
    plan = plan_param_shards(specs, world_size=n, units=[f"layers.{i}" for i in range(units)])
    m = machine(bandwidth=8e9)  # a gather or reduce-scatter takes 0.07 ms, far below a block
    ag, rs = m.time("all_gather", MIB, n), m.time("reduce_scatter", MIB, n)
    cost = predict_zero3(plan, machine=m, model=model(units), topology=Topology.create(n))
    assert cost.step_s == pytest.approx(ag + 4e-3 + ag + 8e-3 + rs)
    gathers = [c for c in cost.comms if c.what.startswith("unit") and c.collective == "all_gather"]
    assert len(gathers) == 2 * units  # forward and again for the backward
    assert cost.ranks[0].memory == estimate_zero3(plan).ranks[0]


def test_zero3_gathers_that_do_not_overlap_compute_add_up():
    """gloo's collectives beside compute on a CPU whose cores compute holds: a slowdown of
    1000 for both kinds, and the step is the sum of every collective and every block."""
    n, units = 2, 4
    specs = layers(units)
    plan = plan_param_shards(specs, world_size=n, units=[f"layers.{i}" for i in range(units)])
    slow = {"all_gather": 1000.0, "reduce_scatter": 1000.0}
    m = machine(bandwidth=1e9, overlap_slowdowns=slow)
    ag, rs = m.time("all_gather", MIB, n), m.time("reduce_scatter", MIB, n)
    cost = predict_zero3(plan, machine=m, model=model(units), topology=Topology.create(n))
    assert cost.step_s == pytest.approx(units * (2 * ag + rs) + 12e-3, rel=1e-3)
    hidden = predict_zero3(
        plan, machine=machine(bandwidth=1e9), model=model(units), topology=Topology.create(n)
    )
    assert hidden.step_s < cost.step_s - (units - 1) * ag  # with overlap, the gathers hide


def _xla_zero3(units, world_size, activation, dp_shard=None, reshard=True):
    """JAX's ZeRO-3 step (one XLA program, donated) over ``units`` 1 MiB blocks."""
    specs = layers(units)
    config = Configuration(zero=3, overlap=False, reshard_after_forward=reshard, dp_shard=dp_shard)
    m, profile = machine(), model(units, activation=activation)
    jax = predict(specs, config, world_size=world_size, machine=m, model=profile, executor="jax")
    torch = predict(specs, config, world_size=world_size, machine=m, model=profile)
    return jax, torch


def test_xla_zero3_keep_holds_every_unit_but_the_first_then_a_gradient_in_its_place():
    """Kept units: all but the first (its backward reads no parameter: its input is the
    data) at the backward's start; the last unit's whole gradient then takes its gathered
    parameters' place, beside its reduce-scattered shard. Gradients are stepped as they come,
    so none is resident."""
    a = 64 << 10
    jax, torch = _xla_zero3(4, 4, a, reshard=False)
    shard = MIB // 4
    params, state = 4 * shard, 8 * shard  # Adam: 8 bytes of state per element
    assert jax.peak_bytes == params + state + (2 * MIB + MIB + shard) + 4 * a
    r = jax.cost.ranks[0]
    assert r.memory.gradient_bytes == 0 and r.activation_bytes == 4 * a
    assert torch.peak_bytes > jax.peak_bytes + MIB  # fully_shard keeps all 4 to their backward


def test_xla_zero3_reshard_holds_a_gradient_beside_the_next_gather_and_the_chunk_copies():
    """One unit gathered at a time; at the last unit's gradient the next unit is gathered
    (issued before the reduce-scatter), and the units gathered again later still hold their
    chunk's copy (one row longer: 1024 fp32 = 4 KiB) from the step's start."""
    a = 64 << 10
    jax, _ = _xla_zero3(4, 4, a)
    shard, row = MIB // 4, 4 << 10
    copies = 2 * (shard + row)  # units 1 and 2 still to gather (unit 0 is never gathered again)
    gradient = MIB + shard  # unit 3's whole gradient and its reduce-scattered shard
    next_unit = MIB - (shard + row)  # unit 2 gathered, its copy read and freed
    assert jax.peak_bytes == 4 * shard + 8 * shard + copies + next_unit + gradient + 4 * a


def test_xla_hsdp_holds_every_gradient_shard_twice_at_the_combined_all_reduce():
    """Under HSDP XLA combines the replicas' all-reduces into one at the backward's end:
    every gradient shard alive as its input and its output."""
    jax, torch = _xla_zero3(4, 4, None, dp_shard=2)
    shard = MIB // 2
    r = jax.cost.ranks[0]
    assert r.memory.gradient_bytes == 4 * shard
    assert jax.peak_bytes == 4 * shard + 8 * shard + 2 * (4 * shard)
    assert jax.step_s == torch.step_s  # the executor changes the memory only


def test_predict_refuses_an_unknown_executor():
    with pytest.raises(ValueError, match="executor 'mlx' is not one of torch, jax"):
        predict(
            layers(2),
            Configuration(),
            world_size=2,
            machine=machine(),
            model=model(2),
            executor="mlx",
        )


def test_hsdp_all_reduces_each_shard_over_the_replicas():
    specs = layers(2)
    p = predict(
        specs, Configuration(zero=3, dp_shard=2), world_size=8, machine=machine(), model=model(2)
    )
    assert p.param_shards.shard_size == 2 and p.param_shards.replicate_size == 4
    replicas = [c for c in p.cost.comms if c.group == "dp_replicate" and c.what.startswith("unit")]
    assert len(replicas) == 2
    assert {(c.collective, c.group_size, c.nbytes) for c in replicas} == {
        ("all_reduce", 4, MIB // 2)
    }


def test_jax_hsdp_all_reduces_every_shard_over_the_replicas_at_once():
    """XLA combines the replicas' all-reduces of a JAX ZeRO-3 step into one at the backward's
    end (one all-reduce of every gradient shard: one latency instead of one per unit)."""
    specs, c = layers(2), Configuration(zero=3, dp_shard=2, overlap=False)
    args = {"world_size": 8, "machine": machine(latency=1e-3), "model": model(2)}
    jax = predict(specs, c, executor="jax", **args)
    torch = predict(specs, c, **args)
    replicas = [e for e in jax.cost.comms if e.group == "dp_replicate"]
    assert [(e.what, e.collective, e.group_size, e.nbytes) for e in replicas] == [
        ("all-reduce (combined)", "all_reduce", 4, MIB)
    ]
    assert len([e for e in torch.cost.comms if e.group == "dp_replicate"]) == 2
    assert jax.step_s == pytest.approx(torch.step_s - 1e-3)


def _zero3_keep(units, world_size, dp_shard=None, **machine_figures):
    """ZeRO-3 with overlap (fully_shard) and ``reshard_after_forward=False``, blocks of no
    compute: every collective costs its latency alone."""
    specs = layers(units)
    prefixes = [f"layers.{i}" for i in range(units)]
    plan = plan_param_shards(specs, world_size=world_size, units=prefixes, dp_shard=dp_shard)
    m = machine(latency=1e-4, bandwidth=1e30, **machine_figures)
    topology = Topology.create(world_size, dp_shard=dp_shard)
    return predict_zero3(
        plan,
        machine=m,
        model=model(units, forward=0.0, backward=0.0),
        topology=topology,
        reshard_after_forward=False,
    )


def test_hsdp_agrees_on_every_collective_with_a_blocking_all_gather_behind_its_channel():
    """fully_shard under HSDP checks each collective: a 32-byte all-gather per rank over the
    group it agrees on, waited for, queued behind that group's collectives in flight. Two
    units of 2 shards x 2 replicas, every collective (and check) one latency ``a``: gather 0
    [a, 2a] after its check [0, a]; unit 1's prefetch after unit 0 is in (check [2a, 3a],
    gather [3a, 4a]); the backward: reduce-scatter 1 (check [4a, 5a], [5a, 6a]); unit 0
    waits for it, then all-reduces it over the replicas (check [6a, 7a], [7a, 8a]) beside its
    own reduce-scatter (check [7a, 8a], [8a, 9a]); then its all-reduce (check [9a, 10a],
    [10a, 11a])."""
    a = 1e-4
    cost = _zero3_keep(2, 4, dp_shard=2)
    assert cost.step_s == pytest.approx(11 * a)
    checks = [c for c in cost.comms if c.what.startswith("agreement")]
    assert len(checks) == 6  # one per collective
    assert {(c.collective, c.nbytes, c.group_size) for c in checks} == {("all_gather", 64, 2)}
    assert sorted(c.group for c in checks).count("dp_replicate") == 2


def test_zero3_without_hsdp_agrees_once_at_the_backwards_start_and_once_at_its_end():
    """Without HSDP fully_shard checks each phase once: two blocking all-gathers. Forward
    gathers [0, a], [a, 2a]; the check [2a, 3a]; reduce-scatters [3a, 4a], [4a, 5a]; the
    check [5a, 6a]."""
    a = 1e-4
    cost = _zero3_keep(2, 2)
    assert cost.step_s == pytest.approx(6 * a)
    checks = [c for c in cost.comms if c.what.startswith("agreement")]
    assert [(c.start_s, c.nbytes) for c in checks] == [
        (pytest.approx(2 * a), 64),
        (pytest.approx(5 * a), 64),
    ]
    # without overlap (one XLA program) nothing is checked
    specs = layers(2)
    plan = plan_param_shards(specs, world_size=2, units=["layers.0", "layers.1"])
    compiled = predict_zero3(
        plan,
        machine=machine(latency=a, bandwidth=1e30),
        model=model(2, forward=0.0, backward=0.0),
        topology=Topology.create(2),
        reshard_after_forward=False,
        overlap=False,
    )
    assert compiled.step_s == pytest.approx(4 * a)
    assert not [c for c in compiled.comms if c.what.startswith("agreement")]


def test_an_agreement_check_is_blocking_so_its_issue_is_inside_the_links_time():
    """A link's time runs from the call to the end (calibrate's measure), so the blocking
    check costs that time alone: an issue cost on the all-gather link delays the step by the
    two checks' time and nothing more, while the unit gathers (asynchronous) pay it each."""
    a, issue = 1e-4, 5e-5
    specs = layers(2)
    plan = plan_param_shards(specs, world_size=2, units=["layers.0", "layers.1"])
    links = tuple(
        LinkCost(
            collective=c,
            group_size=None,
            latency_s=a,
            bus_bandwidth=1e30,
            issue_s=issue if c == "all_gather" else 0.0,
        )
        for c in COLLECTIVES
    )
    m = MachineProfile(name="issued", ranks_per_node=8, links=links)
    args = {
        "model": model(2, forward=0.0, backward=0.0),
        "topology": Topology.create(2),
        "reshard_after_forward": False,
    }
    cost = predict_zero3(plan, machine=m, **args)
    base = predict_zero3(plan, machine=machine(latency=a, bandwidth=1e30), **args)
    checks = [c for c in cost.comms if c.what.startswith("agreement")]
    assert [c.end_s - c.start_s for c in checks] == [pytest.approx(a)] * 2
    # the two forward gathers each pay their issue on the rank; the checks pay none
    assert cost.step_s == pytest.approx(base.step_s + 2 * issue)


# -- the pipeline: the simulator's ticks --------------------------------------------------


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_pipeline_bubble_is_the_simulators_and_the_closed_form(schedule):
    p_, m_ = 4, 8
    specs = layers(8)
    plan = plan_pipeline(schedule=schedule, microbatches=m_, topology=Topology(pp=p_), specs=specs)
    cost = predict_pipeline(
        plan, specs, machine=machine(), model=model(8, forward=1.0, backward=2.0)
    )
    # two blocks per stage: f = 2, b = 4
    assert cost.step_s == pytest.approx((m_ + p_ - 1) * (2.0 + 4.0))
    sim = simulate_pipeline(plan, forward=2.0, backward=4.0, weight=2.0)
    assert cost.step_s == sim.step_time
    assert [r.idle_s for r in cost.ranks] == pytest.approx(list(sim.idle))


def test_pipeline_host_overheads_delay_messages_and_the_data_parallel_sync():
    specs, h_p2p, h_ar, sync = layers(4), 1e-2, 2e-3, 5e-3
    plan = plan_pipeline(
        schedule="1F1B", microbatches=4, topology=Topology(pp=2, dp=2), specs=specs
    )
    m = machine(
        latency=1e-3,
        host_s={"p2p": h_p2p, "all_reduce": h_ar},
        step_host_s={"data_parallel": sync},
    )
    fwd = model(4, forward=1.0, backward=2.0)
    cost = predict_pipeline(plan, specs, machine=m, model=fwd, bucket_cap_mb=64)
    # each message takes its wire (1 ms) and its host work; then each rank pays the sync's
    # bookkeeping, issues its one bucket (its two weights) with its host work and waits for it
    sim = simulate_pipeline(plan, forward=2.0, backward=4.0, weight=2.0, p2p=1e-3 + h_p2p)
    reduce = m.time("all_reduce", 2 * MIB, 2)
    assert cost.step_s == pytest.approx(sim.step_time + sync + h_ar + reduce)
    assert cost.ranks[0].compute_s == pytest.approx(sim.busy[0] + sync + h_ar)


def test_pipeline_stages_sync_in_the_explicit_syncs_layout_with_its_copies():
    """Each stage's DataParallel(overlap=False) reduces fairseq's legacy layout, one reused
    buffer (no DDP first bucket of 1 MiB), copying each bucket in and out, as predict costs
    DDP without overlap."""
    specs = layers(4)  # 1 MiB a block, two blocks a stage
    plan = plan_pipeline(
        schedule="1F1B", microbatches=4, topology=Topology(pp=2, dp=2), specs=specs
    )
    fwd = model(4, forward=1.0, backward=2.0)

    def buckets(cost):
        return [c.nbytes for c in cost.comms if c.what.startswith("pp rank 0 bucket")]

    free = predict_pipeline(plan, specs, machine=machine(latency=1e-3), model=fwd)
    assert buckets(free) == [2 * MIB]  # one buffer of DEFAULT_LEGACY_MAX_NUMEL elements
    capped = predict_pipeline(
        plan, specs, machine=machine(latency=1e-3), model=fwd, bucket_cap_mb=1
    )
    assert buckets(capped) == [MIB, MIB]  # a 1 MiB buffer, reused
    copying = machine(latency=1e-3, copy_bandwidth=MIB / 1e-3)  # 1 ms a MiB
    cost = predict_pipeline(plan, specs, machine=copying, model=fwd)
    assert cost.step_s == pytest.approx(free.step_s + 2 * 2e-3)  # 2 MiB in, 2 MiB out


def test_pipeline_ranks_share_the_machines_cores_when_it_has_fewer_than_ranks():
    """``cores`` fewer than the ranks: the profile's times are read as measured with every
    rank computing (each at cores / world of its speed), and the simulator shares the cores
    among the ranks runnable at each moment, the dp replicas with them; a machine without
    ``cores``, or with one per rank, keeps the closed forms."""
    specs = layers(4)
    fwd = model(4, forward=1.0, backward=2.0)  # a stage: f = 2, b = 4, as profiled
    plan = plan_pipeline(
        schedule="GPipe", microbatches=4, topology=Topology(pp=2, dp=2), specs=specs
    )
    free = {"bandwidth": 1e30}  # the stages' data-parallel sync costs nothing here
    alone = predict_pipeline(plan, specs, machine=machine(**free), model=fwd)
    assert predict_pipeline(plan, specs, machine=machine(cores=4, **free), model=fwd) == alone
    shared = predict_pipeline(plan, specs, machine=machine(cores=2, **free), model=fwd)
    sim = simulate_pipeline(
        plan, forward=1.0, backward=2.0, weight=1.0, cores=2.0, dp=2
    )  # each time at cores / world = 1/2 of the profile's
    assert shared.step_s == pytest.approx(sim.step_time)
    assert shared.step_s < alone.step_s  # a bubble leaves its cores to the busy ranks
    assert any("share 2 cores" in note for note in shared.notes)
    with pytest.raises(ValueError, match="cores must be a positive int"):
        machine(cores=0)
    assert MachineProfile.from_json(json.loads(json.dumps(machine(cores=2).to_json()))).cores == 2


def test_pipeline_message_posts_are_the_simulators_post_and_receive_post():
    specs, send, receive = layers(4), 0.3, 0.1
    plan = plan_pipeline(schedule="1F1B", microbatches=4, topology=Topology(pp=2), specs=specs)
    m = machine(latency=1e-3, post_s={"send": send, "receive": receive})
    cost = predict_pipeline(plan, specs, machine=m, model=model(4, forward=1.0, backward=2.0))
    sim = simulate_pipeline(
        plan, forward=2.0, backward=4.0, weight=2.0, p2p=1e-3, post=send, receive_post=receive
    )
    # the closed form: 4 microbatches of (2 + 4) on 2 ranks, one bubble of 2 + 4, and every
    # send and receive posted on the critical path's clock delays the step beyond it
    assert cost.step_s == pytest.approx(sim.step_time)
    assert cost.step_s > 5 * 6.0 + 2 * send
    assert cost.ranks[0].compute_s == pytest.approx(sim.busy[0] + sim.host[0])
    assert sim.host[0] == pytest.approx(4 * send + 4 * receive)  # 4 sends, 4 gradient receives
    none = predict_pipeline(
        plan, specs, machine=machine(latency=1e-3), model=model(4, forward=1.0, backward=2.0)
    )
    assert none.step_s == pytest.approx(
        simulate_pipeline(plan, forward=2.0, backward=4.0, weight=2.0, p2p=1e-3).step_time
    )
    with pytest.raises(ValueError, match="post_s has the unknown key 'recv'"):
        machine(post_s={"recv": 1e-4})


def test_the_simulator_charges_a_ranks_first_forward_and_a_backward_after_a_forward():
    """GPipe, p = 2, m = 4, f = 1, b = 2, no message time: (m + p - 1)(f + b) = 15 plus, on the
    critical path, both ranks' first forward (a each) and the two backwards right after a
    forward (rank 1's B0, then rank 0's B0: c each)."""
    a, c = 0.25, 0.5
    costs = {"first_forward": a, "backward_after_forward": c}
    gpipe, one_f_one_b = (
        plan_pipeline(schedule=s, microbatches=4, topology=Topology(pp=2), layers=4)
        for s in ("GPipe", "1F1B")
    )
    plain = simulate_pipeline(gpipe, forward=1.0, backward=2.0, weight=1.0)
    sim = simulate_pipeline(gpipe, forward=1.0, backward=2.0, weight=1.0, **costs)
    assert plain.step_time == pytest.approx(15.0)
    assert sim.step_time == pytest.approx(15.0 + 2 * a + 2 * c)
    # each rank: one first forward and one backward after a forward (F3 B0) under GPipe; under
    # 1F1B rank 0 runs F0 F1 B0 F2 B1 F3 B2 B3 (3 after a forward), rank 1 F0 B0 F1 B1 ... (4)
    assert list(sim.busy) == pytest.approx([12 + a + c] * 2)
    sim = simulate_pipeline(one_f_one_b, forward=1.0, backward=2.0, weight=1.0, **costs)
    assert list(sim.busy) == pytest.approx([12 + a + 3 * c, 12 + a + 4 * c])
    assert sim.step_time > 15.0 + 2 * a + 2 * c  # 1F1B pays c on more of its path
    # the time-ordered walk (ranks sharing cores, here one each) charges the same
    shared = simulate_pipeline(one_f_one_b, forward=1.0, backward=2.0, weight=1.0, cores=2, **costs)
    assert shared.step_time == pytest.approx(sim.step_time)
    assert list(shared.busy) == pytest.approx(list(sim.busy))
    with pytest.raises(ValueError, match="first_forward must be a finite time >= 0"):
        simulate_pipeline(gpipe, first_forward=-1.0)


def test_phase_starts_are_the_end_blocks_time_beyond_the_others_rate():
    n = 1 << 18
    blocks = [(3.0, 1.0), (1.0, 1.0), (1.0, 1.0), (1.0, 4.0)]  # (forward, backward)
    prof = timed(blocks)
    # the first block's forward beyond 1 per n elements, the last one's backward beyond it
    assert phase_starts(prof, [n] * 4) == pytest.approx((2.0, 3.0))
    # a first block of 8 n elements (an embedding) costs less than its share: no start
    assert phase_starts(prof, [8 * n, n, n, n]) == pytest.approx((0.0, 3.0))
    assert phase_starts(replace(prof, blocks=prof.blocks[:1]), [n]) == (0.0, 0.0)
    assert phase_starts(model(4), [n] * 4) == (0.0, 0.0)  # uniform blocks: none


def test_a_pipeline_pays_the_profiles_phase_starts_where_the_executor_does():
    """The profile's first-block forward surplus s is the step's start, its last block's
    backward surplus t the backward's: a stage's time leaves them out, each rank pays s at its
    first forward and t at each backward right after a forward (measured on 2 gloo ranks:
    docs/cost-model.md), so GPipe (f = 2, b = 4, m = 4, p = 2) costs 5 (f + b) + 2 s + 2 t,
    and 1F1B, whose backwards mostly follow forwards, more."""
    s, t = 0.5, 0.25
    specs = layers(4)
    blocks = [(1.0 + s, 2.0), (1.0, 2.0), (1.0, 2.0), (1.0, 2.0 + t)]
    prof = timed(blocks)
    costs = {}
    for schedule in ("GPipe", "1F1B"):
        plan = plan_pipeline(
            schedule=schedule, microbatches=4, topology=Topology(pp=2), specs=specs
        )
        costs[schedule] = predict_pipeline(plan, specs, machine=machine(), model=prof).step_s
    assert costs["GPipe"] == pytest.approx(5 * 6.0 + 2 * s + 2 * t)
    assert costs["1F1B"] > costs["GPipe"]
    # charged per microbatch instead (the stage sums), 1F1B came out ahead: 32 against 33
    sums = {
        schedule: simulate_pipeline(
            plan_pipeline(schedule=schedule, microbatches=4, topology=Topology(pp=2), layers=4),
            forward=[2 + s, 2],
            backward=[4, 4 + t],
            weight=[2, 2],
        ).step_time
        for schedule in ("GPipe", "1F1B")
    }
    assert sums == {"GPipe": pytest.approx(33.0), "1F1B": pytest.approx(32.0)}


def test_pipeline_stash_memory_follows_the_schedule():
    specs = layers(4)
    prof = model(4, activation=MIB)
    gpipe = predict(
        specs,
        Configuration(pp=2, schedule="GPipe", microbatches=4),
        world_size=2,
        machine=machine(),
        model=prof,
    )
    one_f_one_b = predict(
        specs,
        Configuration(pp=2, schedule="1F1B", microbatches=4),
        world_size=2,
        machine=machine(),
        model=prof,
    )
    # GPipe stashes all 4 microbatches on rank 0 (2 blocks of 1 MiB each); 1F1B at most 2
    assert gpipe.cost.ranks[0].activation_bytes == 4 * 2 * MIB
    assert one_f_one_b.cost.ranks[0].activation_bytes == 2 * 2 * MIB


def test_a_pipeline_without_data_parallelism_has_no_buckets():
    specs = layers(4)
    config = Configuration(pp=2, schedule="1F1B", microbatches=4, bucket_cap_mb=64)
    alone = predict(specs, config, world_size=2, machine=machine(), model=model(4))
    rank = alone.cost.ranks[0].memory  # two 1 MiB weights, Adam: P + G + 2P of state
    assert (rank.parameter_bytes, rank.gradient_bytes, rank.transient_bytes) == (
        2 * MIB,
        2 * MIB,
        0,
    )
    assert not [c for c in alone.cost.comms if c.collective == "all_reduce"]
    replicated = predict(specs, config, world_size=4, machine=machine(), model=model(4))
    assert replicated.cost.ranks[0].memory.transient_bytes == 2 * MIB  # one bucket of both


# -- memory -------------------------------------------------------------------------------


def test_collective_scratch_adds_to_the_backward_peak_where_the_collective_allocates_it():
    specs, n = layers(4), 2
    gloo = machine(collective_scratch={"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 0.5})
    for zero, extra in ((0, MIB // 2), (1, MIB // 2), (2, 0)):  # ZeRO-2 scatters into its shard
        config = Configuration(zero=zero, bucket_cap_mb=1)
        base = predict(specs, config, world_size=n, machine=machine(), model=model(4))
        cost = predict(specs, config, world_size=n, machine=gloo, model=model(4))
        assert cost.peak_bytes == base.peak_bytes + extra, zero
    # ZeRO-3: the next unit's all-gather (its whole 1 MiB output) beside a reduce-scatter
    # (its whole 1 MiB input); under HSDP also the all-reduce of a 0.5 MiB shard, half of it
    for config, extra in (
        (Configuration(zero=3), 2 * MIB),
        (Configuration(zero=3, dp_shard=2), 2 * MIB + MIB // 4),
    ):
        world = 2 if config.dp_shard is None else 4
        base = predict(specs, config, world_size=world, machine=machine(), model=model(4))
        cost = predict(specs, config, world_size=world, machine=gloo, model=model(4))
        assert cost.cost.ranks[0].collective_bytes == extra
        assert cost.peak_bytes == base.peak_bytes + extra


def test_memory_is_the_plans_estimate_plus_activations_and_the_optimizer_scratch():
    specs = layers(4)
    buckets = plan_buckets(specs)
    states = estimate_ddp(specs, buckets, world_size=2).ranks[0]
    few = model(4, activation=MIB // 4)  # activations below the gradients they turn into
    cost = predict_data_parallel(
        specs, buckets, machine=machine(), model=few, topology=Topology.create(2)
    )
    # the worst moment: the last block's backward, its gradient (1 MiB) beside all activations
    assert cost.ranks[0].activation_bytes == MIB // 4
    assert cost.peak_bytes == states.peak_bytes + MIB // 4
    heavy = ModelProfile(samples=8, source="given", optimizer_bytes=8 * MIB, blocks=few.blocks)
    cost = predict_data_parallel(
        specs, buckets, machine=machine(), model=heavy, topology=Topology.create(2)
    )
    assert cost.peak_bytes == states.peak_bytes + 8 * MIB  # the step: P + G + S + buckets + scratch


GLOO = {"all_gather": 1.0, "reduce_scatter": 1.0}  # each allocates its whole buffer again


def _torch_zero3(reshard, activation, units=4, world_size=2):
    """``fully_shard``'s step over ``units`` 1 MiB blocks, gloo's scratch, Adam."""
    specs = layers(units)
    config = Configuration(zero=3, reshard_after_forward=reshard)
    m, profile = machine(collective_scratch=GLOO), model(units, activation=activation)
    return predict(specs, config, world_size=world_size, machine=m, model=profile)


def test_torch_zero3_keep_peaks_at_the_last_units_reduce_scatter_beside_every_kept_unit():
    """Kept units stay gathered until their own backward is done, and no gradient exists
    before the backward (zero_grad frees them): the worst moment is the last unit's
    reduce-scatter, its input (1 MiB) and gloo's copy of it (1 MiB) beside its shard
    (0.5 MiB), the 4 gathered units and the activations of the 3 blocks before it. Every
    shard of the gradients is counted only once the backward made it."""
    a = 64 << 10
    p = _torch_zero3(reshard=False, activation=a)
    shard = MIB // 2
    params, state = 4 * shard, 4 * 8 * MIB // 8  # Adam: 8 bytes per element, half each
    assert p.peak_bytes == params + state + 4 * MIB + 2 * MIB + shard + 3 * a
    r = p.cost.ranks[0]
    assert (r.collective_bytes, r.activation_bytes) == (MIB, 3 * a)
    assert r.memory.gradient_bytes == 4 * shard  # after the backward: the optimizer's
    assert r.memory.transient_bytes == 4 * MIB + MIB + shard - 4 * shard
    # gradsync plan --zero keeps estimate_zero3's bound: every unit, every gradient shard
    # and the worst unit's backward (its gradients and the reduce input, less its shard)
    bound = estimate_zero3(p.param_shards, reshard_after_forward=False).ranks[0]
    assert bound.transient_bytes == 4 * MIB + 2 * MIB - shard


def test_torch_zero3_reshard_peaks_in_a_backward_with_a_prefetch_and_a_reduce_in_flight():
    """With reshard_after_forward each unit is gathered again for its backward, the next
    one prefetched as it starts, and a unit's reduce-scatter waited for only when the next
    one is issued (fully_shard's start_reduce). The worst moment is unit 1's backward: its
    gathered parameters and gradient (1 MiB each), unit 0's prefetch (its 0.5 MiB input,
    1 MiB output and gloo's 1 MiB scratch), unit 2's reduce-scatter still in flight (its
    1 MiB input and 1 MiB copy), the shards of units 3 and 2, and two blocks' activations."""
    a = 64 << 10
    p = _torch_zero3(reshard=True, activation=a)
    shard = MIB // 2
    params, state = 4 * shard, 4 * MIB
    held = (MIB + MIB) + (shard + MIB + MIB) + (MIB + MIB) + 2 * shard
    assert p.peak_bytes == params + state + held + 2 * a
    r = p.cost.ranks[0]
    assert (r.collective_bytes, r.activation_bytes) == (2 * MIB, 2 * a)
    assert r.memory.transient_bytes == held - 2 * MIB - 4 * shard


def test_torch_zero3_activations_take_what_the_gradients_not_yet_made_leave():
    """Large activations and many units: the worst moment is the last block's backward,
    before most gradient shards exist, so it holds less than the parameters, state and every
    gradient shard besides its activations; the parts still add up to the moment (scratch,
    then activations, then the rest) and none is negative."""
    a, units = 4 * MIB, 8
    specs = layers(units)
    config = Configuration(zero=3)
    p = predict(specs, config, world_size=2, machine=machine(), model=model(units, activation=a))
    r = p.cost.ranks[0]
    shard = MIB // 2
    params, state = units * shard, units * MIB
    # every block's activations; unit 7 gathered and its gradient (1 MiB each); unit 6's
    # prefetch (its 0.5 MiB input and 1 MiB output)
    assert p.peak_bytes == params + state + units * a + MIB + MIB + (shard + MIB)
    assert (r.collective_bytes, r.memory.transient_bytes) == (0, 0)
    assert r.activation_bytes == units * a + 3 * MIB + shard - units * shard


def test_zero1_steps_one_broadcast_job_at_a_time_so_its_scratch_is_the_largest_jobs():
    """torch's ZeroRedundancyOptimizer steps each sync job's parameters right before their
    broadcast: the optimizer's scratch (8 MiB for the whole model's step) scales with the
    largest job, a 1 MiB weight alone, not with the 2 weights a rank owns."""
    specs = layers(4)
    heavy = replace(model(4), optimizer_bytes=8 * MIB)
    for zero, world, stepped in ((1, 2, MIB), (1, 4, MIB), (2, 2, 2 * MIB)):
        config = Configuration(zero=zero, bucket_cap_mb=25)
        p = predict(specs, config, world_size=world, machine=machine(), model=heavy)
        r = p.cost.ranks[0]
        m = r.memory
        resident = m.parameter_bytes + m.gradient_bytes + m.optimizer_state_bytes
        persistent = m.transient_bytes if zero == 1 else 0  # DDP's bucket lives through it
        # ZeRO-2's flat shard steps the rank's range of the one 4 MiB bucket at once
        assert r.optimizer_peak_bytes == resident + persistent + 8 * MIB * stepped // (4 * MIB)
    small = [ParamSpec(name=f"layers.{i}.weight", shape=(64, 1024)) for i in range(4)]
    p = predict(
        small,
        Configuration(zero=1, bucket_cap_mb=25),
        world_size=2,
        machine=machine(),
        model=heavy,
    )
    m = p.cost.ranks[0].memory
    resident = m.parameter_bytes + m.gradient_bytes + m.optimizer_state_bytes + m.transient_bytes
    # 256 KiB weights are packed: a rank's two in one job, half the model
    assert p.cost.ranks[0].optimizer_peak_bytes == resident + 4 * MIB


# -- predict and the search ---------------------------------------------------------------


def test_predict_plans_what_the_executors_plan():
    specs = layers(4)
    ddp = predict(specs, Configuration(), world_size=2, machine=machine(), model=model(4))
    initial = plan_buckets(specs, cap_bytes=25 * MIB, first_cap_bytes=MIB)
    ready = [s.name for s in reversed(specs)]  # the last block's gradient first
    assert ddp.buckets == rebuild_buckets(initial, specs, ready)  # DDP's steady state
    legacy = predict(
        specs, Configuration(overlap=False), world_size=2, machine=machine(), model=model(4)
    )
    assert legacy.buckets == plan_legacy_buckets(specs)
    assert set(ddp.fingerprints) == {"buckets", "topology"}


def test_predict_refuses_a_batch_that_does_not_split():
    with pytest.raises(ValueError, match="does not split over dp 4 x 1 microbatches"):
        predict(
            layers(2),
            Configuration(),
            world_size=4,
            machine=machine(),
            model=model(2),
            global_batch=6,
        )


def test_search_ranks_what_fits_and_says_why_the_rest_was_dropped():
    specs = layers(8)
    prof = model(8, optimizer=4e-3)
    m = machine(latency=1e-5, bandwidth=1e10)
    everything = search_configurations(specs, world_size=4, machine=m, model=prof)
    limit = 30 * MIB
    result = search_configurations(
        specs, world_size=4, machine=m, model=prof, memory_per_rank=limit
    )
    assert len(result.ranked) + len(result.dropped) == len(configurations(specs, world_size=4))
    assert all(p.peak_bytes <= limit for p in result.ranked)
    assert [p.step_s for p in result.ranked] == sorted(p.step_s for p in result.ranked)
    fitting = [p for p in everything.ranked if p.peak_bytes <= limit]
    assert result.best.step_s == min(p.step_s for p in fitting)
    too_big = [d for d in result.dropped if "over the 30.00 MiB per rank" in d.reason]
    assert too_big and all(
        d.configuration in {p.configuration for p in everything.ranked} for d in too_big
    )
    nothing = search_configurations(specs, world_size=4, machine=m, model=prof, memory_per_rank=1)
    with pytest.raises(ValueError, match=r"no configuration fits: ddp default cap: peak .* MiB"):
        _ = nothing.best


def test_search_result_json_lists_the_ranked_and_the_dropped():
    result = search_configurations(
        layers(4), world_size=2, machine=machine(), model=model(4), memory_per_rank=20 * MIB
    )
    out = json.loads(json.dumps(result.to_json(top=2)))
    assert out["kind"] == "cost_search" and len(out["ranked"]) == 2
    assert all("reason" in d for d in out["dropped"])


def test_configuration_refuses_what_no_executor_runs():
    with pytest.raises(ValueError, match="needs a schedule"):
        Configuration(pp=2)
    with pytest.raises(ValueError, match=r"dp_shard \(HSDP\) applies to zero=3 only"):
        Configuration(zero=1, dp_shard=2)
    with pytest.raises(ValueError, match="use it with zero=2"):
        Configuration(zero=1, param_sync="all_gather")
    assert math.isfinite(
        predict(
            layers(2), Configuration(zero=2), world_size=2, machine=machine(), model=model(2)
        ).step_s
    )
