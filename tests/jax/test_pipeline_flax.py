"""Flax models as pipelines (issue 36 item 2): an NNX and a linen model with scanned blocks,
split into stages by the plan, train as the whole model does.

The reference is the Flax model itself, unpipelined: its ``__call__`` (blocks under
``nnx.scan`` / ``nn.scan``) differentiated per microbatch and accumulated as in
``test_pipeline.reference``; loss, parameters and Adam moments within 1e-5 relative.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gradsync_core import Topology, plan_pipeline
from gradsync_jax import mesh_from_topology, shard_optimizer
from gradsync_jax.pipeline import (
    linen_model,
    natural_params,
    nnx_model,
    nnx_state,
    pipeline_params,
    pipeline_step,
)
from tests.jax.models import MLPBlock, ParallelMLPBlock
from tests.jax.pipeline_problem import SEQ, VOCAB, make_batch, reference
from tests.support.asserts import assert_tree_close
from tests.support.xla import FAST_COMPILE

pytestmark = pytest.mark.slow

DIM, HIDDEN = 8, 16


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.ln = nnx.LayerNorm(DIM, rngs=rngs)
        self.fc1 = nnx.Linear(DIM, HIDDEN, rngs=rngs)
        self.fc2 = nnx.Linear(HIDDEN, DIM, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.fc2(nnx.gelu(self.fc1(self.ln(x))))


class Head(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.out = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.norm(x))


class Net(nnx.Module):
    """The Flax way to scan layers: blocks made under ``nnx.vmap``, run by ``nnx.scan``."""

    def __init__(self, layers: int, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs: nnx.Rngs) -> Block:
            return Block(rngs)

        self.blocks = blocks(rngs)
        self.head = Head(rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x: jax.Array, block: Block) -> jax.Array:
            return block(x)

        return self.head(run(self.embed(tokens), self.blocks))


def run(
    model: Any,
    natural: Any,
    grad_fn: Any,
    schedule: str,
    pp: int,
    v: int,
    zero: bool,
    tp: int = 1,
    specs: Any = None,
    inner: Any = None,
) -> Any:
    topology = Topology.create(8, pp=pp, tp=tp)
    mesh = mesh_from_topology(topology)
    m = 2 * pp
    plan = plan_pipeline(
        schedule=schedule,
        microbatches=m,
        topology=topology,
        layers=2 * pp * v,
        stages_per_rank=v,
        input_weight=0,
        output_weight=0,
    )
    inner = optax.adam(1e-2) if inner is None else inner
    tx = shard_optimizer(inner, mesh) if zero else inner
    step = pipeline_step(model, tx, mesh, plan, param_specs=specs)
    batches = [make_batch(topology.dp, m, seed) for seed in range(2)]
    params = pipeline_params(natural, plan, mesh, specs)
    state = step.init(params)
    compiled = step.lower(params, state, batches[0]).compile(compiler_options=FAST_COMPILE)
    losses = []
    for batch in batches:
        params, state, loss = compiled(params, state, batch)
        losses.append(float(loss))
    ref_params, ref_state, ref_losses = reference(
        natural, batches, plan, topology.dp, inner, grad_fn
    )
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    got = natural_params(params, plan)
    assert_tree_close(got, ref_params, rtol=1e-5, what="params")
    assert_tree_close(step.natural_state(state, params), ref_state, rtol=1e-5, what="state")
    return got


@pytest.mark.slow  # 12 s
def test_nnx_model() -> None:
    pp, v = 2, 2
    net = Net(2 * pp * v, nnx.Rngs(0))
    model, natural, _ = nnx_model(net.embed, net.blocks, net.head, cross_entropy)
    graphdef, _ = nnx.split(net)

    @jax.jit
    def grad_fn(params: Any, tokens: jax.Array, targets: jax.Array) -> Any:
        # the whole NNX model, its blocks under nnx.scan, on the same parameters
        return jax.value_and_grad(lambda p: cross_entropy(nnx.merge(graphdef, p)(tokens), targets))(
            params
        )

    trained = run(model, natural, grad_fn, "ZB1P", pp, v, zero=False)
    # written back into the modules, the Flax model computes with the trained weights
    for part in ("embed", "blocks", "head"):
        nnx.update(getattr(net, part), nnx_state(getattr(net, part), trained[part]))
    tokens = make_batch(1, 1, 5)[0]
    expected = nnx.merge(graphdef, jax.tree.map(jnp.asarray, trained))(tokens)
    np.testing.assert_array_equal(np.asarray(net(tokens)), np.asarray(expected))


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, None]:
        h = nn.Dense(HIDDEN)(nn.LayerNorm()(x))
        return x + nn.Dense(DIM)(nn.gelu(h)), None  # nn.scan's (carry, output)


class LinenHead(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


class LinenNet(nn.Module):
    layers: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(VOCAB, DIM, name="embed")(tokens)
        scanned = nn.scan(
            LinenBlock,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.layers,
        )
        x, _ = scanned(name="layers")(x)
        return LinenHead(name="head")(x)


def test_linen_model_with_zero1() -> None:
    pp = 4
    net = LinenNet(layers=2 * pp)
    variables = net.init(jax.random.key(0), jnp.zeros((2, SEQ), jnp.int32))["params"]
    natural = {
        "embed": variables["embed"],
        "blocks": variables["layers"],
        "head": variables["head"],
    }
    model = linen_model(nn.Embed(VOCAB, DIM), LinenBlock(), LinenHead(), cross_entropy)

    @jax.jit
    def grad_fn(params: Any, tokens: jax.Array, targets: jax.Array) -> Any:
        def loss(p: Any) -> jax.Array:
            full = {"embed": p["embed"], "layers": p["blocks"], "head": p["head"]}
            return cross_entropy(net.apply({"params": full}, tokens), targets)

        return jax.value_and_grad(loss)(params)

    run(model, natural, grad_fn, "1F1B", pp, 1, zero=True)


class TensorParallelNet(nnx.Module):
    """``Net`` with blocks whose MLP is column- then row-parallel over ``tp`` (or serial)."""

    def __init__(self, layers: int, parallel: bool, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        make = ParallelMLPBlock if parallel else MLPBlock

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs: nnx.Rngs) -> Any:
            return make(DIM, HIDDEN, rngs=rngs)

        self.blocks = blocks(rngs)
        self.head = Head(rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x: jax.Array, block: Any) -> jax.Array:
            return block(x)

        return self.head(run(self.embed(tokens), self.blocks))


def test_tensor_parallel_stages() -> None:
    """pp 2 x dp 2 x tp 2: each stage's blocks split their MLP over ``tp`` (gradsync's
    ``ColumnParallelLinear``/``RowParallelLinear``) and train as the serial model does.

    SGD with momentum: the row-parallel partial sums change the gradients' rounding (1e-6
    relative, measured), which Adam's first steps divide by |g| and magnify where a gradient
    is near zero; momentum SGD keeps parameters and state linear in the gradients."""
    pp, layers = 2, 4
    net = TensorParallelNet(layers, parallel=True, rngs=nnx.Rngs(0))
    model, natural, specs = nnx_model(net.embed, net.blocks, net.head, cross_entropy)
    assert specs["blocks"]["fc1"]["kernel"] == jax.sharding.PartitionSpec(None, "tp")
    serial = TensorParallelNet(layers, parallel=False, rngs=nnx.Rngs(0))
    graphdef, serial_params = nnx.split(serial, nnx.Param)
    assert jax.tree.structure(nnx.to_pure_dict(serial_params)) == jax.tree.structure(natural)

    @jax.jit
    def grad_fn(params: Any, tokens: jax.Array, targets: jax.Array) -> Any:
        return jax.value_and_grad(lambda p: cross_entropy(nnx.merge(graphdef, p)(tokens), targets))(
            params
        )

    momentum = optax.sgd(0.1, momentum=0.9)
    run(model, natural, grad_fn, "1F1B", pp, 1, zero=False, tp=2, specs=specs, inner=momentum)
