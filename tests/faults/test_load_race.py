"""A load racing a save reads one version or fails with a sentence, never a mix (issue 21,
item 2; docs/design.md §9).

Deterministic: the loader is paused right after it read and checked the manifest of version
1, a save then switches the path to version 2 (and removes version 1), and the load goes on.
Reading the rank files through the path again would return version 2's weights under version
1's manifest, silently; a load that resolved the path once reads version 1 or nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
import torch

import gradsync_core.cli._checkpoint as cli_checkpoint
import gradsync_jax.checkpoint.model_state as jax_model_state
import gradsync_torch.checkpoint.model_state as torch_model_state
from gradsync_core.cli._main import main as cli_main
from gradsync_jax import load_params, save_optimizer_state
from gradsync_torch import load_model_weights
from tests.faults import jax_save_worker as worker

REMOVED = r"was removed by a later save while it was being read; load again"


def _save(path: Path, tx: Any, params: Any, value: float, step: int) -> None:
    weights = jax.tree.map(lambda x: jnp.full_like(x, value), params)
    save_optimizer_state(path, tx, tx.init(weights), weights, step=step, model=weights)


def _pause_after_manifest(monkeypatch: pytest.MonkeyPatch, module: Any, save: Any) -> None:
    real = module.read_manifest

    def read_then_save(directory: Any, **kwargs: Any) -> Any:
        manifest = real(directory, **kwargs)
        save()  # a concurrent job switches the path here
        return manifest

    monkeypatch.setattr(module, "read_manifest", read_then_save)


def test_a_load_never_mixes_two_versions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tx, params = worker.problem()
    path = tmp_path / "ckpt"
    _save(path, tx, params, 1.0, step=1)
    saves = iter(range(2, 10))

    def next_save() -> None:
        step = next(saves)
        _save(path, tx, params, float(step), step=step)

    _pause_after_manifest(monkeypatch, jax_model_state, next_save)
    with pytest.raises(ValueError, match=REMOVED):
        load_params(path, params)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = torch.nn.Linear(6, 10)
            self.head = torch.nn.Linear(10, 3)

    net = Net()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    _pause_after_manifest(monkeypatch, torch_model_state, next_save)
    with pytest.raises(ValueError, match=REMOVED):
        load_model_weights(path, net)
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())

    # Without a racing save, the loads read the version the path names, whole.
    monkeypatch.undo()
    loaded = load_params(path, params)
    latest = float(next(saves) - 1)
    assert all(bool((leaf == latest).all()) for leaf in jax.tree.leaves(loaded))
    load_model_weights(path, net)
    assert all(bool((p == latest).all()) for p in net.parameters())


def test_inspect_never_mixes_two_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # ``gradsync checkpoint inspect`` reads the manifest, then every file's size and header:
    # through the version it resolved first, so a save in between makes it fail with one
    # line (exit 2) saying so, never print version 2's files under version 1's manifest.
    tx, params = worker.problem()
    path = tmp_path / "ckpt"
    _save(path, tx, params, 1.0, step=1)
    _pause_after_manifest(monkeypatch, cli_checkpoint, lambda: _save(path, tx, params, 2.0, step=2))
    assert cli_main(["checkpoint", "inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "removed by a later save" in err, err
    monkeypatch.undo()
    assert cli_main(["checkpoint", "inspect", "--json", str(path)]) == 0
    assert '"step": 2' in capsys.readouterr().out


def _pause_after(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, save: Any) -> None:
    """Run ``save`` right after ``module.name`` returns: the point where a load has checked
    the version's hashes and has not read its tensors yet."""
    real = getattr(module, name)

    def check_then_save(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        save()  # a concurrent job switches the path and removes the version being read
        return out

    monkeypatch.setattr(module, name, check_then_save)


def test_every_load_names_a_removed_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 33, item 7: the tensor reads after the hash check ended in a bare
    # FileNotFoundError (torch's ZeRO load, safe_open) or "cannot be read" without the way
    # out (JAX); every load path now says what happened and what to do, in one sentence.
    import gradsync_jax.checkpoint.zero as jax_zero
    import gradsync_torch.checkpoint.zero as torch_zero
    from gradsync_jax import load_optimizer_state
    from gradsync_torch import load_optimizer_state_dict

    tx, params = worker.problem()
    path = tmp_path / "ckpt"
    _save(path, tx, params, 1.0, step=1)
    saves = iter(range(2, 20))

    def next_save() -> None:
        step = next(saves)
        _save(path, tx, params, float(step), step=step)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = torch.nn.Linear(6, 10)
            self.head = torch.nn.Linear(10, 3)

    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    # The ZeRO load's reader (checkpoint.zero.load, also behind ZeroRedundancyOptimizer.load
    # and load_param_shards), between its hash check and its tensor reads.
    _pause_after(monkeypatch, torch_zero, "verify_file_hashes", next_save)
    with pytest.raises(ValueError, match=REMOVED):
        load_optimizer_state_dict(path, opt, net)
    assert opt.state_dict()["state"] == {}
    _pause_after_manifest(monkeypatch, torch_model_state, next_save)
    with pytest.raises(ValueError, match=REMOVED):
        load_model_weights(path, net)
    _pause_after_manifest(monkeypatch, jax_zero, next_save)
    with pytest.raises(ValueError, match=REMOVED):
        load_optimizer_state(path, optax_adam(), params)
    _pause_after_manifest(monkeypatch, jax_model_state, next_save)
    with pytest.raises(ValueError, match=REMOVED):
        load_params(path, params)

    monkeypatch.undo()  # without a racing save, every load reads the version the path names
    load_optimizer_state_dict(path, opt, net)
    assert load_model_weights(path, net).step == next(saves) - 1
    assert opt.state_dict()["state"][0]["exp_avg"].shape == (10, 6)


def optax_adam() -> Any:
    import optax

    return optax.adam(1e-2)
