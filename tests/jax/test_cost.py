"""The JAX side of the cost model (docs/cost-model.md): calibrating the local devices and
profiling a model's blocks over the mesh."""

import jax
import jax.numpy as jnp
import optax
import pytest

from gradsync_core import Topology
from gradsync_core.plan import COLLECTIVES, Configuration, MachineProfile, ModelProfile, predict
from gradsync_jax import mesh_from_topology, param_specs
from gradsync_jax.cost.machine import calibrate
from gradsync_jax.cost.model import profile_model


@pytest.mark.slow
def test_calibrate_two_devices_fits_every_collective():
    profile = calibrate(jax.devices()[:2], sizes=(64 << 10, 4 << 20), repeats=2, name="two")
    assert {link.collective for link in profile.links} == set(COLLECTIVES)
    assert all(link.group_size == 2 and link.bus_bandwidth > 0 for link in profile.links)
    assert profile.copy_bandwidth > 0 and "jax" in profile.source
    assert MachineProfile.from_json(profile.to_json()) == profile


def test_calibrate_refuses_one_device():
    with pytest.raises(ValueError, match="needs 2 devices or more"):
        calibrate(jax.devices()[:1])


def _blocks(width=16, layers=3):
    keys = jax.random.split(jax.random.key(0), layers)
    params = {
        f"layers.{i}.weight": jax.random.normal(k, (width, width)) / 4 for i, k in enumerate(keys)
    }
    blocks = [
        (f"layers.{i}", lambda p, h: jnp.tanh(h @ p), params[f"layers.{i}.weight"])
        for i in range(layers)
    ]
    return params, blocks


def test_profile_model_over_the_mesh_and_a_prediction_from_it():
    params, blocks = _blocks()
    mesh = mesh_from_topology(Topology.create(8))
    x = jnp.ones((32, 16))
    profile = profile_model(
        blocks,
        x,
        lambda y: jnp.mean(y**2),
        samples=4,
        mesh=mesh,
        tx=optax.adam(1e-3),
        steps=2,
        warmup=1,
    )
    assert [b.prefix for b in profile.blocks] == ["layers.0", "layers.1", "layers.2"]
    assert profile.forward_s > 0 and profile.backward_s > 0 and profile.optimizer_s >= 0
    assert all(b.output_bytes == 4 * 16 * 4 for b in profile.blocks)  # 4 rows a device
    assert ModelProfile.from_json(profile.to_json()) == profile
    links = MachineProfile.from_json(
        {
            "kind": "machine_profile",
            "version": 1,
            "name": "toy",
            "ranks_per_node": 8,
            "links": [
                {"collective": c, "latency_s": 1e-5, "bus_bandwidth": 1e9} for c in COLLECTIVES
            ],
        }
    )
    p = predict(
        param_specs(params),
        Configuration(zero=3, overlap=False),
        world_size=8,
        machine=links,
        model=profile,
    )
    assert p.step_s > profile.forward_s + profile.backward_s
