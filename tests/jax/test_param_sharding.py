"""ZeRO-3 for JAX (gradsync_jax.param_sharding) equals one device, at 2, 4 and 8 devices.

The model has every dim-0 case the plan cuts (in torch's layout): a tied embedding of 6 rows
(fewer than 8 devices), a frozen layer of 3 rows, 11 rows (uneven at every size) and 5. After
8 steps the parameters and both AdamW moments must equal the unsharded single-device run
within the same-framework floor of tests/parity/test_cross_checkpoint.py (1e-5 relative for
parameters, 5e-5 for moments: 4x what the order of a gradient sum alone moves them), and the
frozen layer must not move at all.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from gradsync_jax import (
    MixedPrecisionPolicy,
    param_layout,
    shard_params,
    unshard_params,
    zero3_step,
)
from tests.jax.zero3_problem import (
    BATCH,
    DIM,
    FROZEN,
    RTOL,
    STEPS,
    UNITS,
    VOCAB,
    adamw,
    data,
    init_params,
    loss_fn,
    reference,
    train,
    without_frozen,
)
from tests.support.asserts import assert_close, rel_err
from tests.support.meshes import dp_mesh as mesh_of  # this file's name for it

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("n", "reshard"), [(2, True), (4, True), (8, True), (4, False)], ids=str)
def test_adamw_equals_one_device(n: int, reshard: bool) -> None:
    layout, sharded, opt_state, _ = train(adamw(), n, reshard=reshard)
    want_params, want_state = reference(adamw(), init_params())
    got = unshard_params(sharded, layout)
    assert_close(got, want_params, RTOL["params"], "params")
    np.testing.assert_array_equal(
        got["params"]["frozen"]["kernel"], init_params()["params"]["frozen"]["kernel"]
    )
    adam = opt_state[0]
    assert int(adam.count) == STEPS == int(want_state[0].count)
    for moment in ("mu", "nu"):
        got_m = without_frozen(unshard_params(getattr(adam, moment), layout))
        assert_close(got_m, getattr(want_state[0], moment), RTOL["state"], moment)


def test_sgd_momentum_equals_one_device() -> None:
    tx = optax.sgd(0.05, momentum=0.9)
    layout, sharded, opt_state, _ = train(tx, 8)
    want_params, want_state = reference(tx, init_params())
    assert_close(unshard_params(sharded, layout), want_params, RTOL["params"], "params")
    trace = without_frozen(unshard_params(opt_state[0].trace, layout))
    assert_close(trace, want_state[0].trace, RTOL["state"], "trace")


def test_storage_is_the_padded_dim0_chunk_in_torch_layout() -> None:
    params = init_params()
    layout = param_layout(params, world_size=8, units=UNITS, frozen=FROZEN)
    sharded = shard_params(params, mesh_of(8), layout)
    kernel = sharded["params"]["layers_0"]["kernel"]  # Flax (3, 11) = torch (11, 3)
    assert kernel.shape == (16, 3)  # 8 devices x ceil(11 / 8) = 2 rows
    shards = sorted(kernel.addressable_shards, key=lambda s: s.index[0].start)
    assert [s.data.shape for s in shards] == [(2, 3)] * 8
    want = np.asarray(params["params"]["layers_0"]["kernel"]).T
    for r, shard in enumerate(shards):
        chunk = layout.plan.chunk("layers_0.weight", r)
        held = chunk.stop - chunk.start
        np.testing.assert_array_equal(np.asarray(shard.data)[:held], want[chunk.start : chunk.stop])
        assert not np.asarray(shard.data)[held:].any()  # zero padding
    embed = sharded["params"]["embed"]["embedding"]  # 6 rows < 8 devices
    assert embed.shape == (8, DIM)
    adam = zero3_step(loss_fn, adamw(), mesh_of(8), layout).init(sharded)[0]
    assert adam.mu["params"]["frozen"]["kernel"] is None  # frozen: no optimizer state
    assert adam.mu["params"]["layers_0"]["kernel"].sharding.spec == kernel.sharding.spec


def _lowered(n: int, reshard: bool, options=None):
    """The step lowered for the test model (``options``: its ``compiler_options``)."""
    params = init_params()
    layout = param_layout(params, world_size=n, units=UNITS, frozen=FROZEN)
    sharded = shard_params(params, mesh_of(n), layout)
    step = zero3_step(
        loss_fn,
        adamw(),
        mesh_of(n),
        layout,
        reshard_after_forward=reshard,
        compiler_options=options,
    )
    return step.lower(sharded, step.init(sharded), data())


def _all_gathers(lowered, *, compiled: bool = False) -> int:
    """All-gathers in the program JAX hands to XLA (StableHLO), or in the one XLA made."""
    if compiled:
        return len(re.findall(r" all-gather\(", lowered.compile().as_text()))
    return len(re.findall(r"stablehlo\.all_gather", lowered.as_text()))


def test_reshard_after_forward_gathers_again_for_the_backward() -> None:
    # 7 gathers per forward, one per parameter: the tied embedding, the frozen layer's 2 and
    # the 2 blocks' 2 each. Without resharding they are kept to the backward.
    kept = _lowered(4, False)
    assert _all_gathers(kept) == _all_gathers(kept, compiled=True) == 7
    # Resharding gathers at each equation that reads a parameter: the embedding twice (the
    # lookup and the head), so 8 in the forward; and again for each backward that reads one:
    # the 3 weights (the frozen one too, for its input gradient) and the head's embedding,
    # not the biases nor the lookup, whose gradient formulas do not read them (XLA drops
    # those gathers). Each backward gather reads its chunks through that equation's
    # cotangent, so XLA's CSE cannot merge it with the forward's: the compiled step keeps all.
    resharded = _lowered(4, True)
    assert _all_gathers(resharded, compiled=True) == 8 + 4


def test_each_unit_is_gathered_where_the_model_reads_it() -> None:
    """In the compiled step, a layer's gathers come after the previous layer's matmul (the
    default XLA:CPU scheduler would otherwise issue every gather first), and the backward's
    after the next layer's backward matmuls: the order is a data dependency."""
    for reshard in (False, True):
        text = _lowered(4, reshard).compile().as_text()
        entry = text[text.index("ENTRY") :]
        order = "".join(
            "G" if " all-gather(" in line else "D"
            for line in entry.splitlines()
            if " all-gather(" in line or re.search(r"= \S+ (dot|fusion)\(.*dot", line)
        )
        assert not order.startswith("G" * 7), (reshard, order)


def test_not_elementwise_is_refused_with_advice_that_works() -> None:
    """Adafactor's factored moment reads across a tensor's rows: refused, and the advice
    (``data_parallel_step`` with ``shard_optimizer(tx, mesh)``) runs it."""
    from gradsync_jax import data_parallel_step, shard_optimizer

    params = init_params()
    layout = param_layout(params, world_size=4, units=UNITS)
    tx = optax.adafactor(1e-2)
    with pytest.raises(
        ValueError, match=r"cannot run this optimizer exactly on each device's rows"
    ) as err:
        zero3_step(loss_fn, tx, mesh_of(4), layout)
    assert "data_parallel_step(loss_fn, shard_optimizer(tx, mesh), mesh)" in str(err.value)
    mesh = mesh_of(4)
    sharded_tx = shard_optimizer(tx, mesh)
    step = data_parallel_step(loss_fn, sharded_tx, mesh)
    _, _, loss = step(params, sharded_tx.init(params), data())
    assert np.isfinite(float(loss))


def test_bad_input_is_refused_with_a_sentence() -> None:
    params = init_params()
    with pytest.raises(ValueError, match="unit 'layers_9' matches no parameter"):
        param_layout(params, world_size=4, units=["layers_9"])
    with pytest.raises(ValueError, match="frozen path 'nope' matches no parameter"):
        param_layout(params, world_size=4, frozen=["nope"])
    layout = param_layout(params, world_size=4)
    with pytest.raises(ValueError, match="planned for 4 devices but the mesh axis 'dp' has 8"):
        shard_params(params, mesh_of(8), layout)


class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(7, 11, rngs=rngs), nnx.Linear(11, 3, rngs=rngs)])

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.layers[1](jnp.tanh(self.layers[0](x)))


def test_nnx_model_equals_one_device() -> None:
    rng = np.random.default_rng(2)
    batch = (
        jnp.asarray(rng.normal(size=(BATCH, 7)), jnp.float32),
        jnp.asarray(rng.normal(size=(BATCH, 3)), jnp.float32),
    )
    graphdef, params = nnx.split(NnxNet(nnx.Rngs(0)), nnx.Param)

    def nnx_loss(p, b):
        return jnp.mean((nnx.merge(graphdef, p)(b[0]) - b[1]) ** 2)

    ref, state = params, adamw().init(params)
    for _ in range(STEPS):
        updates, state = adamw().update(jax.grad(nnx_loss)(ref, batch), state, ref)
        ref = optax.apply_updates(ref, updates)

    layout = param_layout(params, world_size=8, units=["layers/0", "layers/1"])
    assert [u.prefix for u in layout.plan.units] == ["", "layers.0", "layers.1"]
    sharded = shard_params(params, mesh_of(8), layout)
    step = zero3_step(nnx_loss, adamw(), mesh_of(8), layout)
    opt_state = step.init(sharded)
    for _ in range(STEPS):
        sharded, opt_state, _ = step(sharded, opt_state, batch)
    assert_close(unshard_params(sharded, layout), ref, RTOL["params"], "params")
    assert_close(unshard_params(opt_state[0].nu, layout), state[0].nu, RTOL["state"], "nu")


def assert_trained_like(sharded, opt_state, layout, want_params, want_state) -> None:
    """Parameters and both AdamW moments within the floor of the one-device run's."""
    assert_close(unshard_params(sharded, layout), want_params, RTOL["params"], "params")
    for moment in ("mu", "nu"):
        got_m = without_frozen(unshard_params(getattr(opt_state[0], moment), layout))
        assert_close(got_m, getattr(want_state[0], moment), RTOL["state"], moment)


def test_accumulation_on_an_explicit_mesh_equals_one_device() -> None:
    """3 micro-steps, each reduce-scattering, equal one step on the whole batch; an
    Explicit-axes mesh (the default of ``mesh_from_topology``) takes a batch placed anywhere;
    a ``tx`` that syncs again is refused."""
    from gradsync_core import Topology
    from gradsync_jax import mesh_from_topology, shard_optimizer, synced

    params = init_params()
    layout = param_layout(params, world_size=4, units=UNITS, frozen=FROZEN)
    mesh = mesh_from_topology(Topology.create(4), jax.devices()[:4])
    step = zero3_step(loss_fn, adamw(), mesh, layout, accumulate_steps=3)
    assert step.accumulate_steps == 3
    sharded = shard_params(params, mesh, layout)
    opt_state = step.init(sharded)
    with pytest.raises(ValueError, match="multiple of 4 devices x accumulate_steps 3 = 12"):
        step(sharded, opt_state, (data()[0][:8], data()[1][:8]))
    for _ in range(STEPS):
        sharded, opt_state, _ = step(sharded, opt_state, data())
    want_params, want_state = reference(adamw(), init_params())
    assert_trained_like(sharded, opt_state, layout, want_params, want_state)
    for syncing in (optax.chain(synced("dp"), adamw()), shard_optimizer(adamw(), mesh)):
        with pytest.raises(ValueError, match="without synced"):
            zero3_step(loss_fn, syncing, mesh, layout)


def _tied_reads_apart(params, tokens, e_in, e_out):
    """The model with its tied embedding's two reads as two arguments (the lookup, the head)."""
    p = params["params"]
    h = nn.Embed(VOCAB, DIM).apply({"params": {"embedding": e_in}}, tokens)
    for name, width in (("frozen", 3), ("layers_0", 11), ("layers_1", DIM)):
        h = jnp.tanh(nn.Dense(width).apply({"params": p[name]}, h))
    return nn.Embed(VOCAB, DIM).apply({"params": {"embedding": e_out}}, h, method="attend")


def mixed_reference(tx, params, n: int, *, reads_apart: bool, steps: int = STEPS):
    """One device, the same precision: each of the ``n`` devices' batches computed with the
    parameters in bf16, its gradient cast to fp32, the fp32 mean of the ``n`` taken.

    ``reads_apart``: the tied embedding's two reads get their bf16 gradients separately and
    they are summed in fp32, as ``reshard_after_forward=True`` sums them (each read gathers
    and reduce-scatters on its own, gradsync_jax/param_sharding/order.py); the plain program
    sums them in bf16 first (measured 2e-3 relative on the embedding's gradient, then 1e-3
    in every layer after 8 steps: bf16 rounding of one sum, not a sharding error)."""
    frozen = params["params"]["frozen"]
    trainable = without_frozen(params)

    def half_grad(t, batch):
        half = jax.tree.map(
            lambda p: p.astype(jnp.bfloat16), {"params": {**t["params"], "frozen": frozen}}
        )
        if not reads_apart:
            return jax.grad(lambda h: loss_fn(h, batch))(half)
        table = half["params"]["embed"]["embedding"]

        def loss_of(h, e_in, e_out):
            logits = _tied_reads_apart(h, batch[0], e_in, e_out)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

        g, g_in, g_out = jax.grad(loss_of, argnums=(0, 1, 2))(half, table, table)
        g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
        g["params"]["embed"]["embedding"] = g_in.astype(jnp.float32) + g_out.astype(jnp.float32)
        return g

    @jax.jit  # compiled, as the sharded step is: XLA keeps fused intermediates in fp32
    def local_grad(t, batch):
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), half_grad(t, batch))
        return without_frozen(grads)

    state = tx.init(trainable)
    tokens, labels = data()
    for _ in range(steps):
        parts = [
            local_grad(trainable, (x, y))
            for x, y in zip(jnp.split(tokens, n), jnp.split(labels, n), strict=True)
        ]
        grads = jax.tree.map(lambda *g: sum(g[1:], g[0]) / n, *parts)
        updates, state = tx.update(grads, state, trainable)
        trainable = optax.apply_updates(trainable, updates)
    return {"params": {**trainable["params"], "frozen": frozen}}, state


@pytest.mark.parametrize(("n", "reshards"), [(2, (False,)), (4, (False, True))], ids=str)
def test_bf16_compute_fp32_master_and_reduction(n: int, reshards: tuple[bool, ...]) -> None:
    """``mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: the parameters
    and state stay fp32 and equal
    the one-device run of the same precision within the fp32 floor (measured about 1e-7),
    with and without ``reshard_after_forward``.

    With the resharding, the tied embedding's two reads are gathered and reduce-scattered
    apart, so their bf16 gradients are summed in fp32; the one-device run sums them the same
    way (``mixed_reference(reads_apart=True)``)."""
    params = init_params()
    layout = param_layout(params, world_size=n, units=UNITS, frozen=FROZEN)
    mesh = mesh_of(n)
    for reshard in reshards:
        step = zero3_step(
            loss_fn,
            adamw(),
            mesh,
            layout,
            mp_policy=MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32),
            reshard_after_forward=reshard,
        )
        sharded = shard_params(params, mesh, layout)
        opt_state = step.init(sharded)
        for _ in range(STEPS):
            sharded, opt_state, _ = step(sharded, opt_state, data())
        assert {str(x.dtype) for x in jax.tree.leaves((sharded, opt_state[0].mu))} == {"float32"}
        want_params, want_state = mixed_reference(adamw(), init_params(), n, reads_apart=reshard)
        assert_trained_like(sharded, opt_state, layout, want_params, want_state)
    # And it is bf16 arithmetic: the fp32 run differs by far more than the floor.
    fp32_params, _ = reference(adamw(), init_params())
    err = rel_err(
        unshard_params(sharded, layout)["params"]["layers_0"]["kernel"],
        fp32_params["params"]["layers_0"]["kernel"],
    )
    assert err > 100 * RTOL["params"], err


@pytest.mark.parametrize(("replicas", "shards"), [(2, 2), (2, 4)], ids=str)
def test_hybrid_sharding_equals_one_device(replicas: int, shards: int) -> None:
    """HSDP on a 2-D mesh ``("replicate", "shard")``: cut over the shard axis, gradients
    reduce-scattered there and all-reduced across the replicas; the plan is torch's HSDP plan
    (``dp_shard``); the result equals one device."""
    params = init_params()
    n = replicas * shards
    layout = param_layout(params, world_size=n, units=UNITS, frozen=FROZEN, dp_shard=shards)
    assert (layout.world_size, layout.plan.replicate_size) == (shards, replicas)
    devices = np.array(jax.devices()[:n]).reshape(replicas, shards)
    mesh = Mesh(devices, ("replicate", "shard"))
    with pytest.raises(ValueError, match="replicate_axis_name"):
        zero3_step(loss_fn, adamw(), mesh, layout, axis_name="shard")
    step = zero3_step(
        loss_fn, adamw(), mesh, layout, axis_name="shard", replicate_axis_name="replicate"
    )
    sharded = shard_params(params, mesh, layout, axis_name="shard")
    opt_state = step.init(sharded)
    for _ in range(STEPS):
        sharded, opt_state, _ = step(sharded, opt_state, data())
    want_params, want_state = reference(adamw(), init_params())
    assert_trained_like(sharded, opt_state, layout, want_params, want_state)


@pytest.mark.slow
def test_hybrid_sharding_on_the_topologys_mesh() -> None:
    """The topology's HSDP split is the mesh: ``mesh_from_topology(Topology.create(4,
    dp_shard=2))`` has ``("dp_replicate", "dp_shard")`` in place of ``"dp"``, and
    ``zero3_step``/``shard_params`` with their default ``axis_name="dp"`` cut over dp_shard and
    replicate over dp_replicate: bitwise the run on the hand-made ``("replicate", "shard")``
    mesh of the same devices. A layout without the split runs plain ZeRO-3 over both axes."""
    from gradsync_core import Topology
    from gradsync_jax import mesh_from_topology

    params, batch = init_params(), data()
    topology = Topology.create(4, dp_shard=2)
    layout = param_layout(
        params, world_size=topology.dp, units=UNITS, frozen=FROZEN, dp_shard=topology.dp_shard
    )
    by_hand = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("replicate", "shard"))
    runs = []
    for mesh, axes in (
        (mesh_from_topology(topology, jax.devices()[:4]), {}),
        (by_hand, {"axis_name": "shard", "replicate_axis_name": "replicate"}),
    ):
        step = zero3_step(loss_fn, adamw(), mesh, layout, **axes)
        sharded = shard_params(params, mesh, layout, axis_name=axes.get("axis_name", "dp"))
        opt_state = step.init(sharded)
        for _ in range(3):
            sharded, opt_state, _ = step(sharded, opt_state, batch)
        runs.append(jax.tree.map(np.asarray, (unshard_params(sharded, layout), opt_state)))
    jax.tree.map(np.testing.assert_array_equal, runs[0], runs[1])
    # Without the split in the layout, "dp" on that mesh is both axes: plain ZeRO-3 over 4.
    plain = param_layout(params, world_size=4, units=UNITS, frozen=FROZEN)
    mesh = mesh_from_topology(topology, jax.devices()[:4])
    step = zero3_step(loss_fn, adamw(), mesh, plain)
    assert step.axes == ("dp_replicate", "dp_shard")
    wrong = param_layout(params, world_size=4, units=UNITS, frozen=FROZEN, dp_shard=1)
    with pytest.raises(ValueError, match=r"replicate_size=4 but .* world_size=4, dp_shard=2\)"):
        zero3_step(loss_fn, adamw(), mesh, param_layout(params, world_size=8, dp_shard=2))
    with pytest.raises(ValueError, match=r"planned for 1 devices but .* dp_shard=2\)"):
        zero3_step(loss_fn, adamw(), mesh, wrong)


def test_the_old_spellings_warn_once_and_step_alike(deprecations) -> None:
    """``param_layout(replicate_size=)`` is ``dp_shard=world_size // replicate_size`` and
    ``zero3_step(param_dtype=, reduce_dtype=)`` is ``mp_policy=``: the same layout, the same
    step's bits, one warning each."""
    params = init_params()
    layout = param_layout(params, world_size=4, units=UNITS, frozen=FROZEN, dp_shard=2)
    assert deprecations.messages == []
    for _ in range(2):
        assert param_layout(params, world_size=4, units=UNITS, frozen=FROZEN, replicate_size=2) == (
            layout
        )
    mesh, dtypes = mesh_of(2), {"param_dtype": jnp.bfloat16, "reduce_dtype": jnp.float32}
    plain = param_layout(params, world_size=2, units=UNITS, frozen=FROZEN)
    runs = []
    for options in ({"mp_policy": MixedPrecisionPolicy(**dtypes)}, dtypes):
        step = zero3_step(loss_fn, adamw(), mesh, plain, **options)
        sharded = shard_params(params, mesh, plain)
        sharded, opt_state, _ = step(sharded, step.init(sharded), data())
        runs.append(jax.tree.map(np.asarray, (sharded, opt_state)))
    jax.tree.map(np.testing.assert_array_equal, runs[0], runs[1])
    zero3_step(loss_fn, adamw(), mesh, plain, **dtypes)  # again: no second warning
    assert deprecations.messages == [
        "param_layout(replicate_size=) is deprecated and will be removed: use "
        "param_layout(dp_shard=world_size // replicate_size)",
        "zero3_step(param_dtype=, reduce_dtype=) is deprecated and will be removed: use "
        "zero3_step(mp_policy=MixedPrecisionPolicy(param_dtype=, reduce_dtype=))",
    ]
    with pytest.raises(TypeError, match="mp_policy= and its deprecated spellings"):
        zero3_step(loss_fn, adamw(), mesh, plain, mp_policy=MixedPrecisionPolicy(), **dtypes)
    with pytest.raises(ValueError, match="param_dtype must be a floating dtype"):
        MixedPrecisionPolicy(param_dtype=jnp.int8)


@jax.custom_jvp
def _gate(v: jax.Array) -> jax.Array:
    return jax.nn.sigmoid(v)


_gate.defjvp(lambda primals, tangents: (_gate(primals[0]), tangents[0] * 0.25))


@jax.custom_vjp
def _halved_gradient(v: jax.Array) -> jax.Array:
    return v


_halved_gradient.defvjp(lambda v: (v, None), lambda _, g: (0.5 * g,))


@jax.jit
def _jitted_block(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.tanh(x @ w.T)  # the parameter read through a transpose, inside a jit call


def _structured_loss(params, batch):
    """A parameter read inside a ``jax.jit`` call, stacked layers in a ``lax.scan``, custom-JVP
    and custom-VJP functions of parameters, a parameter used by two equations, one seen
    through ``stop_gradient`` (no gradient from that read) and one in a ``jax.checkpoint``."""
    x, y = batch
    h = _jitted_block(x, params["inp"]["w"])
    h, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), h, params["stack"]["w"])
    h = h * _gate(params["gate"]["v"]) + params["gate"]["v"]
    h = h + jnp.sum(jax.lax.stop_gradient(params["inp"]["w"]))
    h = jax.checkpoint(lambda a, m: jnp.tanh(a @ m))(h, params["remat"]["w"])
    return jnp.mean((h @ _halved_gradient(params["out"]["w"]) - y) ** 2)


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "kept"])
def test_loss_structure_is_followed_exactly(reshard: bool) -> None:
    """The step gathers each parameter where the loss's jaxpr computes with it: inside a jit
    call, a scan over stacked layers (gathered for the whole scan), custom-JVP and custom-VJP
    calls, two reads of one parameter, a ``stop_gradient``, a ``jax.checkpoint``. 3 AdamW steps
    at 4 devices equal one device's."""
    rng = np.random.default_rng(3)

    def w(*shape):
        return jnp.asarray(rng.normal(0, 0.5, shape), jnp.float32)

    params = {
        "inp": {"w": w(6, 5)},
        "stack": {"w": w(3, 6, 6)},
        "gate": {"v": w(6)},
        "remat": {"w": w(6, 6)},
        "out": {"w": w(6, 2)},
    }
    batch = (w(16, 5), w(16, 2))
    layout = param_layout(params, world_size=4, units=["inp", "stack", "gate", "remat", "out"])
    mesh = mesh_of(4)
    step = zero3_step(_structured_loss, adamw(), mesh, layout, reshard_after_forward=reshard)
    sharded = shard_params(params, mesh, layout)
    opt_state = step.init(sharded)
    want, state = params, adamw().init(params)
    for _ in range(3):
        sharded, opt_state, _ = step(sharded, opt_state, batch)
        updates, state = adamw().update(jax.grad(_structured_loss)(want, batch), state, want)
        want = optax.apply_updates(want, updates)
    assert_close(unshard_params(sharded, layout), want, RTOL["params"], "params")
    mu = unshard_params(opt_state[0].mu, layout)
    assert_close(mu, state[0].mu, RTOL["state"], "mu")
