"""gradsync checkpoint <-> Orbax (docs/interchange.md).

A torch-written checkpoint of a model with a tied embedding (Flax: one table, ``Embed.
attend``) and a frozen layer (kept out of the optimizer's tree) exports to an Orbax tree that
plain ``orbax.checkpoint`` restores bitwise, and imports back into a gradsync checkpoint that
torch and JAX load bitwise.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from gradsync_core import read_manifest
from gradsync_jax import load_optimizer_state, load_params, to_torch_state
from gradsync_jax.checkpoint.orbax import export_orbax, import_orbax
from gradsync_torch import load_model_weights, load_optimizer_state_dict
from gradsync_torch.checkpoint.plain_save import save_plain
from tests.parity.tied_twin import RENAMES, TiedLinen, adamw, joined, random_variables, split
from tests.parity.tied_worker import VOCAB, TiedLM

pytestmark = pytest.mark.slow

ocp = pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is not installed")


def trained_torch() -> tuple[TiedLM, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.5, 0.75), weight_decay=0.1)
    tokens = torch.arange(12) % VOCAB
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(tokens), (tokens * 5) % VOCAB).backward()
        opt.step()
    return model, opt


def fresh_torch() -> tuple[TiedLM, torch.optim.AdamW]:
    torch.manual_seed(7)
    model = TiedLM()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.5, 0.75))


def assert_trees_equal(a, b) -> None:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_through_orbax_is_bitwise(tmp_path) -> None:
    model, opt = trained_torch()
    save_plain(tmp_path / "src", model, opt)
    variables = random_variables()
    trainable, _ = split(variables)
    templates = {"params": trainable, "tx": adamw(), "model": variables, "modules": RENAMES}
    export_orbax(tmp_path / "src", tmp_path / "orbax", **templates)

    # What a Flax/Optax program does, without gradsync.
    target = {"params": variables, "opt_state": adamw().init(trainable)}
    restored = ocp.StandardCheckpointer().restore(str(tmp_path / "orbax"), target)
    want_state, _ = load_optimizer_state(tmp_path / "src", adamw(), trainable, modules=RENAMES)
    assert_trees_equal(restored["opt_state"], want_state)
    weights = to_torch_state(restored["params"], modules=RENAMES)
    assert "head.weight" not in weights  # the tied table is stored once
    for name, param in model.named_parameters():
        np.testing.assert_array_equal(weights[name], param.detach().numpy())
    logits = TiedLinen().apply(restored["params"], np.arange(4))
    assert logits.shape == (4, VOCAB)

    import_orbax(tmp_path / "orbax", tmp_path / "back", **templates)
    assert read_manifest(tmp_path / "back").step == 3
    torch.manual_seed(5)
    again = TiedLM()
    again_opt = torch.optim.AdamW(again.parameters(), lr=1e-2, betas=(0.5, 0.75))
    load_model_weights(tmp_path / "back", again)
    load_optimizer_state_dict(tmp_path / "back", again_opt, again)
    for (name, x), (_, y) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(x, y), name
    mine, theirs = opt.state_dict()["state"], again_opt.state_dict()["state"]
    assert mine.keys() == theirs.keys()
    for index, state in mine.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[key], theirs[index][key]), (index, key)
    back_state, _ = load_optimizer_state(tmp_path / "back", adamw(), trainable, modules=RENAMES)
    assert_trees_equal(back_state, want_state)
    assert_trees_equal(
        load_params(tmp_path / "back", variables, modules=RENAMES), restored["params"]
    )


def test_wrong_templates_are_one_sentence(tmp_path) -> None:
    model, opt = trained_torch()
    save_plain(tmp_path / "src", model, opt)
    variables = random_variables()
    trainable, _ = split(variables)
    export_orbax(
        tmp_path / "src",
        tmp_path / "orbax",
        params=trainable,
        tx=adamw(),
        model=variables,
        modules=RENAMES,
    )
    with pytest.raises(ValueError, match="cannot restore Orbax checkpoint"):
        import_orbax(tmp_path / "orbax", tmp_path / "back", params=trainable, tx=adamw())


BUILD = """
from tests.parity.tied_twin import RENAMES, adamw, random_variables, split


def build():
    variables = random_variables()
    return {"params": split(variables)[0], "tx": adamw(), "model": variables,
            "modules": RENAMES}
"""


def test_cli_export_and_import(tmp_path) -> None:
    from gradsync_core.cli._main import main

    model, opt = trained_torch()
    save_plain(tmp_path / "src", model, opt)
    (tmp_path / "build.py").write_text(BUILD)
    build = f"{tmp_path / 'build.py'}:build"
    src, out, back = (str(tmp_path / n) for n in ("src", "orbax", "back"))
    assert main(["checkpoint", "export", "--to", "orbax", src, out, "--model", build]) == 0
    assert main(["checkpoint", "import", "--from", "orbax", out, back, "--model", build]) == 0
    variables = random_variables()
    trainable, _ = split(variables)
    want, _ = load_optimizer_state(src, adamw(), trainable, modules=RENAMES)
    got, manifest = load_optimizer_state(back, adamw(), trainable, modules=RENAMES)
    assert_trees_equal(got, want)
    assert manifest.framework == "jax" and manifest.step == 3
    assert_trees_equal(
        load_params(back, variables, modules=RENAMES), load_params(src, variables, modules=RENAMES)
    )


def test_a_jax_checkpoint_of_four_flat_shards_exports_to_both(tmp_path) -> None:
    """Written by JAX on 4 devices (ZeRO-2 flat slices), read whole by DCP and Orbax users."""
    from gradsync_jax import save_optimizer_state, shard_optimizer
    from gradsync_torch.checkpoint.dcp import export_dcp
    from tests.support.meshes import mesh_of
    from tests.torch.dcp_user import user_load_into

    trainable, frozen = split(random_variables())
    rng = np.random.default_rng(0)  # state unlike any init, without compiling a training step
    plain = jax.tree_util.tree_map(
        lambda x: np.abs(rng.standard_normal(x.shape)).astype(x.dtype) if x.ndim else x + 2,
        adamw().init(trainable),
    )
    tx = shard_optimizer(adamw(), mesh_of(4), partition="flat")
    state = tx.scatter_state(plain, trainable)
    src = tmp_path / "src"
    model = joined(trainable, frozen)
    save_optimizer_state(src, tx, state, trainable, step=2, modules=RENAMES, model=model)
    want_state, _ = load_optimizer_state(src, adamw(), trainable, modules=RENAMES)

    export_orbax(
        src, tmp_path / "orbax", params=trainable, tx=adamw(), model=model, modules=RENAMES
    )
    target = {"params": model, "opt_state": adamw().init(trainable)}
    restored = ocp.StandardCheckpointer().restore(str(tmp_path / "orbax"), target)
    assert_trees_equal(restored["opt_state"], want_state)
    assert_trees_equal(restored["params"], model)

    net = TiedLM()
    export_dcp(src, tmp_path / "dcp", net, torch.optim.AdamW(net.parameters()))
    got, got_opt = user_load_into(tmp_path / "dcp", *fresh_torch())
    weights = to_torch_state(model, modules=RENAMES)
    for name, param in got.named_parameters():
        np.testing.assert_array_equal(param.detach().numpy(), weights[name])
    names = dict(enumerate(n for n, _ in got.named_parameters()))
    moments = to_torch_state(want_state[0].mu, modules=RENAMES)
    for index, state in got_opt.state_dict()["state"].items():
        np.testing.assert_array_equal(state["exp_avg"].numpy(), moments[names[index]])
        assert state["step"].item() == 2
