"""The pipeline simulator against the closed forms of the papers (docs/pipeline.md, "Simulator").

With the same forward, backward and weight times on every stage and free point-to-point:

- GPipe and 1F1B idle ``(p-1)(F+B)`` per rank, a bubble of ``(p-1)/(m+p-1)`` of the step
  (GPipe, arXiv:1811.06965; PipeDream-Flush, arXiv:2006.09503);
- interleaved 1F1B with v stages per rank idles ``(p-1)(F+B)`` per rank while computing
  ``v*m*(F+B)``: ``(p-1)/(v*m)`` of the ideal time (Megatron-LM, arXiv:2104.04473);
- interleaved zero bubble (ZB1P) idles ``(p-1)(F+B-2W)`` per rank, B the full backward, so
  ``(p-1)(T_F + T_B - T_W)`` in arXiv:2401.10241's terms where ``T_B`` is the input half.

With ``cores`` the ranks share that many cores (processor sharing): with one core and free
messages the step is the sum of every rank's work, as the core is never idle, and with a
core per rank the step is the closed forms' above.

The interleaved forms hold from m >= p microbatches (torch's schedules warm up for a full
round of p), the zero-bubble one where a weight gradient is no longer than a forward
(W <= F: it fills the gap a forward leaves).
"""

import itertools
from fractions import Fraction

import pytest

from gradsync_core import Topology, plan_pipeline, simulate_pipeline

PP = (2, 3, 4, 8)
# (F, B, W): B is the full backward, W its weight-gradient part, W <= F throughout.
TIMES = [(1, 2, 1), (2, 3, 1), (3, 4, 1), (2, 5, 2), (1, 1, 0), (1, 5, 1)]
SOME_TIMES = [(1, 2, 1), (2, 5, 2), (1, 5, 1)]  # for the long sweeps: F+B-2W = 1, 3, 4


def plan(schedule, pp, m, v=1):
    return plan_pipeline(
        schedule=schedule,
        microbatches=m,
        topology=Topology(pp=pp),
        stages_per_rank=v,
        layers=2 * pp * v,
    )


def accepted(schedule, pp, ms, v):
    for m in ms:
        try:
            yield m, plan(schedule, pp, m, v)
        except ValueError:  # a combination torch refuses (tests/core/test_pipeline.py)
            continue


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("pp", PP)
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule, pp):
    for m, p in accepted(schedule, pp, range(1, 17), 1):
        for f, b, w in TIMES:
            sim = simulate_pipeline(p, forward=f, backward=b, weight=w)
            assert sim.step_time == (m + pp - 1) * (f + b)
            assert sim.idle == ((pp - 1) * (f + b),) * pp
            assert Fraction(sim.bubble).limit_denominator(10**6) == Fraction(pp - 1, m + pp - 1)


@pytest.mark.parametrize(("pp", "v"), list(itertools.product(PP, (1, 2, 3, 4))))
def test_interleaved_1f1b_bubble_is_p_minus_1_over_v_m_of_the_ideal(pp, v):
    checked = 0
    for m, p in accepted("Interleaved1F1B", pp, range(pp, 17), v):
        for f, b, w in SOME_TIMES:
            sim = simulate_pipeline(p, forward=f, backward=b, weight=w)
            ideal = v * m * (f + b)
            assert sim.busy == (ideal,) * pp
            assert all(Fraction(i) / ideal == Fraction(pp - 1, v * m) for i in sim.idle)
        checked += 1
    assert checked


@pytest.mark.parametrize(("pp", "v"), list(itertools.product(PP, (1, 2, 3, 4))))
def test_zb1p_idles_p_minus_1_times_f_plus_b_minus_2w(pp, v):
    checked = 0
    for _, p in accepted("ZB1P", pp, range(pp, 17), v):
        for f, b, w in SOME_TIMES:
            sim = simulate_pipeline(p, forward=f, backward=b, weight=w)
            assert sim.idle == ((pp - 1) * (f + b - 2 * w),) * pp
        checked += 1
    assert checked


def test_zb1p_form_needs_the_weight_gradient_to_fit_a_forward():
    # W > F: the deferred weight gradients no longer fit, the closed form undercounts.
    sim = simulate_pipeline(plan("ZB1P", 4, 8), forward=1, backward=3, weight=2)
    assert sim.idle[0] > (4 - 1) * (1 + 3 - 2 * 2)


def test_p2p_latency_adds_two_hops_per_stage_boundary_to_gpipe():
    pp, m, f, b, c = 4, 6, 2, 3, 0.5
    sim = simulate_pipeline(plan("GPipe", pp, m), forward=f, backward=b, p2p=c)
    # the last microbatch's forward crosses pp-1 links down, its gradient pp-1 links back up
    assert sim.step_time == (m + pp - 1) * (f + b) + 2 * (pp - 1) * c


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("pp", PP)
def test_compute_overhead_adds_2mh_to_gpipe_and_1f1b(schedule, pp):
    """Each compute costs its rank h of host work before it waits for its input.

    GPipe by hand: rank k's forward i starts at ``h + kF + i(F + h)``: rank 0 runs
    ``h, F, h, F, ...`` without waiting, and on rank k > 0 the two bounds of forward i (its
    previous forward's end plus h, rank k-1's forward i's end) are both ``h + kF + i(F+h)``,
    so from its first forward on rank k waits for nothing and its overheads add up, while
    the fill (rank k's first forward waits kF) hides one. The last rank's last forward ends
    at ``(m+p-1)F + mh``; the backwards go up the same way, so rank 0's last backward ends
    ``(m+p-1)B + mh`` later: step ``(m+p-1)(F+B) + 2mh``, idle ``(p-1)(F+B) + 2mh`` per rank,
    host ``2mh`` (2m computes). 1F1B runs the same computes and has the same form.
    """
    for m, p in accepted(schedule, pp, range(1, 17), 1):
        for f, b, h in [(1, 2, 0.5), (2, 3, 0.25), (1, 2, 3)]:
            sim = simulate_pipeline(p, forward=f, backward=b, overhead=h)
            assert sim.step_time == (m + pp - 1) * (f + b) + 2 * m * h
            assert sim.idle == ((pp - 1) * (f + b) + 2 * m * h,) * pp
            assert sim.host == (2 * m * h,) * pp
            assert sim.busy == (m * (f + b),) * pp


@pytest.mark.parametrize(("pp", "v"), list(itertools.product(PP, (2, 3))))
def test_compute_overhead_adds_to_each_of_interleaved_1f1bs_2vm_computes(pp, v):
    # From m >= p no wait hides an overhead: each of a rank's 2vm computes adds h to its idle.
    checked = 0
    for m, p in accepted("Interleaved1F1B", pp, range(pp, 17), v):
        for f, b, h in [(1, 2, 0.5), (2, 3, 0.25)]:
            sim = simulate_pipeline(p, forward=f, backward=b, overhead=h)
            assert sim.idle == ((pp - 1) * (f + b) + 2 * v * m * h,) * pp
        checked += 1
    assert checked


def test_posts_cost_their_rank_2mq_at_pp_2():
    """Posting a send or a receive costs its rank q; a send's data leaves when its post ends.

    GPipe at pp 2 by hand: rank 0 runs ``F, SEND_F`` m times, its forward i's data leaving at
    ``(i+1)(F+q)``; rank 1 runs ``RECV_F, F`` m times, its forward i starting at both
    ``(i+1)(F+q)`` (its clock) and the data's arrival, so it waits for nothing and ends its
    forwards at ``m(F+q) + F``. The backwards go up the same way with ``B, SEND_B`` and
    ``RECV_B, B``: rank 0's last backward ends ``m(B+q) + B`` later, a step of
    ``(m+1)(F+B) + 2mq``; each rank posts 2m messages.
    """
    for m in (1, 3, 8):
        for f, b, q in [(1, 2, 0.5), (2, 3, 5)]:
            sim = simulate_pipeline(plan("GPipe", 2, m), forward=f, backward=b, post=q)
            assert sim.step_time == (m + 1) * (f + b) + 2 * m * q
            assert sim.host == (2 * m * q,) * 2


def test_receive_post_costs_receives_alone():
    """``receive_post`` prices receives apart from sends (gloo's executor posts every receive
    at the step's start, where a send's post is priced as it runs among the computes).

    GPipe at pp 2 by hand. Sends at q, receives free: the step of
    ``test_posts_cost_their_rank_2mq_at_pp_2`` (its receive posts were hidden in the waits),
    ``(m+1)(F+B) + 2mq``, and each rank's host time is its m sends, ``mq``. Receives at r <= F,
    B, sends free: rank 1's forward i starts at ``F + i(F+r)`` (its receive's r after the
    previous forward, the data there since ``(i+1)F``), so its forwards end at
    ``(m+1)F + (m-1)r``; its m backwards follow, each sent at once, and rank 0's backward i
    starts at the first one's data plus ``i(B+r)``: a step of ``(m+1)(F+B) + 2(m-1)r``, each
    rank's host time its m receives, ``mr``.
    """
    for m in (1, 3, 8):
        for f, b, q in [(1, 2, 0.5), (2, 3, 1)]:
            p = plan("GPipe", 2, m)
            sim = simulate_pipeline(p, forward=f, backward=b, post=q, receive_post=0)
            assert sim.step_time == (m + 1) * (f + b) + 2 * m * q
            assert sim.host == (m * q,) * 2
            sim = simulate_pipeline(p, forward=f, backward=b, post=0, receive_post=q)
            assert sim.step_time == (m + 1) * (f + b) + 2 * (m - 1) * q
            assert sim.host == (m * q,) * 2


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("pp", PP)
def test_reduce_grad_adds_to_each_ranks_tail(schedule, pp):
    """A stage's REDUCE_GRAD runs on its rank after its last backward, for ``reduce`` seconds.

    With no reduction rank k's last backward ends at ``(m+p-1)F + (m+p-1-k)B`` (rank 0 last,
    each rank below the last one backward later). The same R on every stage moves every end
    by R: step and idle grow by R. R only on the last stage ends rank p-1 at
    ``(m+p-1)F + mB + R``, the step when that is later than rank 0's ``(m+p-1)(F+B)``.
    """
    m, f, b = pp + 2, 1, 2
    p = plan(schedule, pp, m)
    base = (m + pp - 1) * (f + b)
    sim = simulate_pipeline(p, forward=f, backward=b, reduce=3)
    assert sim.step_time == base + 3
    assert sim.idle == ((pp - 1) * (f + b) + 3,) * pp
    assert sim.host == (3,) * pp
    for r_last in (1, 10 * pp):
        sim = simulate_pipeline(p, forward=f, backward=b, reduce=[0] * (pp - 1) + [r_last])
        assert sim.step_time == max(base, (m + pp - 1) * f + m * b + r_last)
        tail = sim.actions[pp - 1][-1]
        assert (str(tail.action), tail.end - tail.start) == (f"{pp - 1}REDUCE_GRAD", r_last)


def test_every_action_has_its_start_and_end():
    sim = simulate_pipeline(plan("GPipe", 3, 2), forward=1, backward=2)
    rank1 = [(str(t.action), t.start, t.end) for t in sim.actions[1]]
    assert rank1 == [
        ("1RECV_F0", 0.0, 0.0),
        ("1F0", 1.0, 2.0),
        ("1SEND_F0", 2.0, 2.0),
        ("1RECV_F1", 2.0, 2.0),
        ("1F1", 2.0, 3.0),
        ("1SEND_F1", 3.0, 3.0),
        ("1RECV_B0", 3.0, 3.0),
        ("1B0", 6.0, 8.0),  # after rank 2's B0 (4 to 6), which follows its F1 (3 to 4)
        ("1SEND_B0", 8.0, 8.0),
        ("1RECV_B1", 8.0, 8.0),
        ("1B1", 8.0, 10.0),
        ("1SEND_B1", 10.0, 10.0),
        ("1REDUCE_GRAD", 10.0, 10.0),
    ]


def test_per_stage_times_slow_the_pipeline_to_its_slowest_stage():
    # GPipe with one slow stage: the steady state runs at the slow stage's pace.
    p = plan("GPipe", 3, 8)
    sim = simulate_pipeline(p, forward=[1, 3, 1], backward=[2, 6, 2])
    assert sim.busy == (24.0, 72.0, 24.0)
    assert sim.step_time == 1 + 8 * 3 + 1 + 2 + 8 * 6 + 2  # fill, slow stage, drain


def test_overlapped_pairs_run_their_two_halves_back_to_back():
    sim = simulate_pipeline(plan("DualPipeV", 2, 4, 2), forward=1, backward=2, weight=1)
    busy = 4 * 2 * (1 + 2)  # every rank: 4 microbatches through its 2 stages
    assert sim.busy == (busy, busy)
    assert len([t for t in sim.actions[0] if t.action.kind == "F"]) == 8


def test_peak_stash_of_the_simulation_is_the_plans():
    for schedule, v in [("1F1B", 1), ("Interleaved1F1B", 2), ("ZBV", 2), ("DualPipeV", 2)]:
        p = plan(schedule, 4, 8, v)
        assert simulate_pipeline(p).peak_stash == p.peak_stash


SCHEDULES = [
    ("GPipe", 1),
    ("1F1B", 1),
    ("Interleaved1F1B", 2),
    ("LoopedBFS", 2),
    ("ZB1P", 2),
    ("ZBV", 2),
    ("DualPipeV", 2),
]
# every cost non-zero, dyadic so that the event walk's sums are exact
COSTS = dict(
    forward=1.5,
    backward=2.25,
    weight=0.75,
    overhead=0.125,
    post=0.5,
    receive_post=0.0625,
    reduce=0.375,
)


def test_two_ranks_computing_at_once_on_one_core_take_twice_as_long():
    """GPipe at pp 2, 2 microbatches, F = 1, B = 2, on one core, by hand: rank 0's F0 runs
    alone (0 to 1); then rank 0's F1 and rank 1's F0 run at once, each at half speed, 1 to 3;
    rank 1's F1 and B0 run alone, 3 to 6; rank 0's B0 and rank 1's B1 at once, 6 to 10;
    rank 0's B1 alone, 10 to 12: the 12 of work, one core never idle."""
    sim = simulate_pipeline(plan("GPipe", 2, 2), forward=1, backward=2, cores=1)
    computes = [
        [(str(t.action), t.start, t.end) for t in timed if t.action.is_compute]
        for timed in sim.actions
    ]
    assert computes == [
        [("0F0", 0, 1), ("0F1", 1, 3), ("0B0", 6, 10), ("0B1", 10, 12)],
        [("1F0", 1, 3), ("1F1", 3, 4), ("1B0", 4, 6), ("1B1", 6, 10)],
    ]
    assert sim.step_time == 12
    assert sim.busy == (9, 9)  # each rank's computes, stretched where they ran together
    # with a core each, the closed form: (m + p - 1)(F + B)
    assert simulate_pipeline(plan("GPipe", 2, 2), forward=1, backward=2, cores=2).step_time == 9


@pytest.mark.parametrize(("schedule", "v"), SCHEDULES)
@pytest.mark.parametrize("pp", [2, 4])
def test_a_core_per_rank_is_the_unshared_simulation(schedule, v, pp):
    for m, p in accepted(schedule, pp, (pp, 2 * pp, 2 * pp + 1), v):
        unshared = simulate_pipeline(p, p2p=0.25, **COSTS)
        for cores in (pp, pp + 1, 100):
            assert simulate_pipeline(p, p2p=0.25, cores=cores, **COSTS) == unshared, (m, cores)


@pytest.mark.parametrize(("schedule", "v"), SCHEDULES)
@pytest.mark.parametrize("pp", [2, 4])
def test_on_one_core_the_step_is_the_sum_of_all_the_work(schedule, v, pp):
    """With free messages some rank can always run (the plan has no deadlock), so one core
    never idles: the step is every compute, overhead, post and reduction added up."""
    for m, p in accepted(schedule, pp, (pp, 2 * pp), v):
        n, f, b = pp * v, COSTS["forward"], COSTS["backward"]
        posts = sum(
            COSTS["post"] if a.kind in ("SEND_F", "SEND_B") else COSTS["receive_post"]
            for actions in p.actions
            for a in actions
            if a.kind in ("SEND_F", "SEND_B", "RECV_F", "RECV_B")
        )
        computes = sum(len(a.leaves) for actions in p.actions for a in actions if a.is_compute)
        work = n * m * (f + b) + computes * COSTS["overhead"] + posts + n * COSTS["reduce"]
        sim = simulate_pipeline(p, cores=1, **COSTS)
        assert sim.step_time == work
        # half a core (two such pipelines on one core) takes twice as long
        assert simulate_pipeline(p, cores=0.5, **COSTS).step_time == 2 * work


def test_three_ranks_on_two_cores_run_at_two_thirds():
    """GPipe at pp 3, 3 microbatches, F = 3, B = 0, on 2 cores, by hand: forward i of rank k
    is due at 3(i + k) with a core of its own. Rank 0's F0 runs alone (0 to 3); F1 on rank
    0 and F0 on rank 1 together (3 to 6); then three forwards at once (rank 0's F2, rank
    1's F1, rank 2's F0), each at 2/3 speed, 6 to 10.5; then two (rank 1's F2, rank 2's F1),
    10.5 to 13.5; rank 2's F2 alone, 13.5 to 16.5."""
    sim = simulate_pipeline(plan("GPipe", 3, 3), forward=3, backward=0, weight=0, cores=2)
    forwards = [[(t.start, t.end) for t in timed if t.action.kind == "F"] for timed in sim.actions]
    assert forwards == [
        [(0, 3), (3, 6), (6, 10.5)],
        [(3, 6), (6, 10.5), (10.5, 13.5)],
        [(6, 10.5), (10.5, 13.5), (13.5, 16.5)],
    ]
    assert sim.step_time == 16.5


def test_without_replicas_the_results_are_the_same_bits_as_before():
    """dp = 1 (the default) runs the same walks as before ``dp`` existed: these are the bits
    the simulator gave at commit 0b5b1aa for times no binary fraction holds exactly (a core
    per rank, and 2 ranks on 1.5 cores)."""
    p = plan("ZB1P", 2, 8, 2)
    times = dict(
        forward=[0.1, 0.11, 0.12, 0.13],
        backward=0.23,
        weight=0.09,
        p2p=0.003,
        overhead=0.0002,
        post=0.0009,
        receive_post=0.0001,
        reduce=[0.021, 0.022, 0.023, 0.024],
    )
    for cores, step, idle, host in [
        (
            None,
            "0x1.76703afb7e911p+2",
            ("0x1.a474538ef3510p-2", "0x1.009d495182ae0p-2"),
            ("0x1.3dd97f62b6ae6p-4", "0x1.460aa64c2f836p-4"),
        ),
        (
            1.5,
            "0x1.e87b6d1712fa4p+2",
            ("0x1.b694467381d40p-2", "0x1.19397b043b840p-2"),
            ("0x1.87fcb923a28d2p-4", "0x1.aa1edb45c4b21p-4"),
        ),
    ]:
        sim = simulate_pipeline(p, cores=cores, **times)
        assert sim == simulate_pipeline(p, cores=cores, dp=1, **times)
        assert sim.step_time.hex() == step
        assert tuple(t.hex() for t in sim.idle) == idle
        assert tuple(t.hex() for t in sim.host) == host


@pytest.mark.parametrize(("schedule", "v"), SCHEDULES)
@pytest.mark.parametrize("pp", [2, 4])
def test_identical_replicas_run_as_one_pipeline(schedule, v, pp):
    """dp identical replicas arrive at each reduction together, so none waits for a peer:
    with a core per rank each is the one pipeline (its reduction included); sharing C cores,
    their ranks are runnable at the same moments, so each is one pipeline on C / dp."""
    for m, p in accepted(schedule, pp, (pp, 2 * pp + 1), v):
        alone = simulate_pipeline(p, p2p=0.25, **COSTS)
        for dp in (2, 3):
            sim = simulate_pipeline(p, p2p=0.25, dp=dp, **COSTS)
            assert sim.step_time == alone.step_time, (m, dp)
            for name in ("busy", "idle", "host", "peak_stash", "actions"):
                assert getattr(sim, name) == getattr(alone, name) * dp, (m, dp, name)
            for cores in (1, 2):
                shared = simulate_pipeline(p, p2p=0.25, dp=dp, cores=cores, **COSTS)
                one = simulate_pipeline(p, p2p=0.25, cores=cores / dp, **COSTS)
                assert shared.step_time == one.step_time, (m, dp, cores)
                assert shared.idle == one.idle * dp, (m, dp, cores)


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_replicas_keep_the_closed_form_plus_the_reduction(schedule):
    # test_reduce_grad_adds_to_each_ranks_tail's form, every rank of both replicas
    for pp in PP:
        m, f, b, r = pp + 2, 1, 2, 3
        sim = simulate_pipeline(plan(schedule, pp, m), forward=f, backward=b, reduce=r, dp=2)
        assert sim.step_time == (m + pp - 1) * (f + b) + r
        assert sim.idle == ((pp - 1) * (f + b) + r,) * (2 * pp)
        assert sim.host == (r,) * (2 * pp)


def _reductions(sim):
    return [
        [(str(t.action), t.start, t.end) for t in timed if t.action.kind == "REDUCE_GRAD"]
        for timed in sim.actions
    ]


def test_a_slow_replica_delays_its_peers_reduction():
    """GPipe at pp 2, 2 microbatches, F = 1, B = 2, a core per rank, by hand. Replica 0:
    rank 1 ends its backwards at 7, rank 0 at 9. Replica 1's stage 0 forwards take 2: its
    rank 0 forwards 0-2, 2-4, rank 1 forwards 2-3, 4-5 and backwards 5-7, 7-9, rank 0
    backwards 7-9, 9-11. Each stage's reduction (1) starts when its later copy arrives:
    stage 1 at 9, stage 0 at 11, so replica 0's rank 1 waits 7 to 9 and its rank 0 9 to 11,
    and the step ends at 12 (replica 0 alone: 10)."""
    p = plan("GPipe", 2, 2)
    alone = simulate_pipeline(p, forward=1, backward=2, reduce=1)
    assert alone.step_time == 10
    sim = simulate_pipeline(p, forward=[[1, 1], [2, 1]], backward=2, reduce=1, dp=2)
    assert _reductions(sim) == [
        [("0REDUCE_GRAD", 9, 12)],
        [("1REDUCE_GRAD", 7, 10)],
        [("0REDUCE_GRAD", 11, 12)],
        [("1REDUCE_GRAD", 9, 10)],
    ]
    assert sim.step_time == 12
    assert sim.busy == (6, 6, 8, 6)
    assert sim.idle == (6, 6, 4, 6)
    assert sim.host == (1, 1, 1, 1)  # the waits for the peer are idle, not host work
    # a reduction returns on no copy before every copy's work is done: replica 1's takes 3
    sim = simulate_pipeline(p, forward=[[1, 1], [2, 1]], backward=2, reduce=[[1, 1], [3, 3]], dp=2)
    assert _reductions(sim) == [
        [("0REDUCE_GRAD", 9, 14)],
        [("1REDUCE_GRAD", 7, 12)],
        [("0REDUCE_GRAD", 11, 14)],
        [("1REDUCE_GRAD", 9, 12)],
    ]
    assert sim.host == (1, 1, 3, 3)  # replica 0 waits 2 after its work for its peers'
    assert sim.step_time == 14


def test_replicas_share_the_cores():
    """Both replicas of GPipe at pp 2, 1 microbatch, F = 1, B = 2, on 2 cores, replica 1's
    forwards taking 2, by hand. Never more than 2 ranks run until 6: the rank 0s forward,
    each on a core (replica 0's 0-1, replica 1's 0-2); replica 0's rank 1 forwards 1-2 and
    backwards 2-4 beside replica 1's rank 1 forward (2-4); both rank 1s backward 4-6, and
    replica 0's rank 0 backwards 4-6 too, but replica 1's rank 0 only from 6. From 6 three
    ranks run on the 2 cores at 2/3 speed: stage 1's reduction (1) on both rank 1s, 6 to
    7.5, beside replica 1's rank 0 backward, which then runs alone and ends at 8.5; stage 0's
    reduction, which replica 0's rank 0 arrived at 6, runs 8.5-9.5."""
    sim = simulate_pipeline(
        plan("GPipe", 2, 1), forward=[[1, 1], [2, 2]], backward=2, reduce=1, dp=2, cores=2
    )
    assert _reductions(sim) == [
        [("0REDUCE_GRAD", 6, 9.5)],
        [("1REDUCE_GRAD", 4, 7.5)],
        [("0REDUCE_GRAD", 8.5, 9.5)],
        [("1REDUCE_GRAD", 6, 7.5)],
    ]
    assert sim.step_time == 9.5


@pytest.mark.parametrize(("schedule", "v"), SCHEDULES)
def test_identical_pinned_replicas_run_as_one_pipeline_on_their_cores(schedule, v):
    """Each replica pinned to cores / dp of its own runs as one pipeline on them; identical
    replicas meet at each reduction together, so no replica's wait changes a thing."""
    for m, p in accepted(schedule, 2, (2, 5), v):
        for dp, cores in ((2, 2), (2, 1), (3, 3)):
            sim = simulate_pipeline(p, p2p=0.25, dp=dp, cores=cores, pinned=True, **COSTS)
            one = simulate_pipeline(p, p2p=0.25, cores=cores / dp, **COSTS)
            assert sim.step_time == one.step_time, (m, dp, cores)
            assert sim.idle == one.idle * dp, (m, dp, cores)


def test_a_pinned_replica_keeps_to_its_own_core():
    """GPipe at pp 2, 2 microbatches, on 2 cores; replica 0's work takes no time, replica 1's
    F = 1, B = 2, by hand. Replica 0 is at its reductions at once, waiting on no core.
    Shared, replica 1's two ranks take a core each: the closed form (m + p - 1)(F + B) = 9.
    Pinned, replica 1 has one core: rank 0 forwards 0-1, then both ranks share it (F1 and
    F0 end at 3), rank 1 forwards 3-4 and backwards 4-6, then rank 0's B0 and rank 1's B1
    share it 6-10, rank 0's B1 runs 10-12: the core never idles, the step is all the work."""
    p = plan("GPipe", 2, 2)
    times = {"forward": [[0, 0], [1, 1]], "backward": [[0, 0], [2, 2]], "weight": 0, "dp": 2}
    assert simulate_pipeline(p, cores=2, **times).step_time == 9
    pinned = simulate_pipeline(p, cores=2, pinned=True, **times)
    assert pinned.step_time == 12
    assert [(str(t.action), t.start, t.end) for t in pinned.actions[2]] == [
        ("0F0", 0, 1),
        ("0SEND_F0", 1, 1),
        ("0F1", 1, 3),
        ("0SEND_F1", 3, 3),
        ("0RECV_B0", 3, 3),
        ("0B0", 6, 10),
        ("0RECV_B1", 10, 10),
        ("0B1", 10, 12),
        ("0REDUCE_GRAD", 12, 12),
    ]
    assert _reductions(pinned)[0] == [("0REDUCE_GRAD", 0, 12)]  # replica 0 waits, idle


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pinned": True}, "pinned=True shares cores / dp cores"),
        ({"pinned": 1, "cores": 2}, "pinned must be True or False"),
        ({"weight": 3.0}, "exceeds the full backward"),
        ({"forward": -1.0}, "finite numbers >= 0"),
        ({"forward": float("nan")}, "finite numbers >= 0"),
        ({"backward": [1.0, 2.0]}, "2 times for 4 stages"),
        ({"p2p": -0.5}, "p2p must be"),
        ({"overhead": float("inf")}, "overhead must be"),
        ({"post": -1e-6}, "post must be"),
        ({"reduce": [1.0, -1.0, 0.0, 0.0]}, "reduce times must be finite numbers >= 0"),
        ({"reduce": [1.0]}, "reduce has 1 times for 4 stages"),
        ({"cores": 0}, "cores must be a finite number > 0"),
        ({"cores": -2}, "cores must be a finite number > 0"),
        ({"cores": float("inf")}, "cores must be a finite number > 0"),
        ({"cores": True}, "cores must be a finite number > 0"),
        ({"dp": 0}, "dp must be an integer >= 1"),
        ({"dp": 1.5}, "dp must be an integer >= 1"),
        ({"dp": True}, "dp must be an integer >= 1"),
        ({"forward": [[1.0] * 4] * 3, "dp": 2}, "3 lists of times for 2 replicas"),
        ({"reduce": [[1.0] * 4, [1.0]], "dp": 2}, "reduce has 1 times for 4 stages"),
        ({"weight": [[1.0] * 4, [3.0] * 4], "dp": 2}, "exceeds the full backward"),
    ],
)
def test_bad_times_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        simulate_pipeline(plan("1F1B", 4, 4), **kwargs)
