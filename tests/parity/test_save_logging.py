"""Every gradsync save logs its progress at INFO through ``logging`` and is silent by default
(``gradsync_core.checkpoint._save_protocol``, the one save every executor runs; README,
"One checkpoint, both frameworks").

torch: a plain ``AdamW`` saved with ``save_plain`` (the save ``ZeroRedundancyOptimizer.save``
and ``save_param_shards`` run too); JAX: ``save_optimizer_state`` of a ZeRO-1
``shard_optimizer`` on 2 devices (``save_param_shards`` runs the same ``save_rank_files``).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import optax
import pytest
import torch

from gradsync_core import Topology, read_manifest
from gradsync_jax import mesh_from_topology, save_optimizer_state, shard_optimizer
from gradsync_torch.checkpoint.plain_save import save_plain

LOGGER = "gradsync_core.checkpoint._save_protocol"


def _torch_save(path: str) -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters())
    net(torch.ones(1, 3)).sum().backward()
    opt.step()
    save_plain(path, net, opt)


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def _check(messages: list[str], path: str, header: str) -> None:
    """Start, prepared, written (bytes), saved (what, bytes, elapsed); bytes as on disk."""
    assert len(messages) == 4, messages
    assert messages[0] == f"saving checkpoint {path}"
    assert re.fullmatch(
        rf"checkpoint {re.escape(path)}: state prepared in [0-9.]+ s; writing into .+", messages[1]
    ), messages[1]
    on_disk = sum(os.path.getsize(os.path.join(path, name)) for name in read_manifest(path).files)
    assert messages[2].startswith(
        f"checkpoint {path}: every rank wrote its files, {on_disk} bytes, in "
    )
    saved = rf"saved checkpoint {re.escape(path)}: {re.escape(header)}, \d+ rank files, "
    assert re.fullmatch(saved + rf"{on_disk} bytes, in [0-9.]+ s", messages[3]), messages[3]


def test_a_torch_save_logs_its_progress_at_info(tmp_path, caplog) -> None:
    path = str(tmp_path / "ckpt")
    with caplog.at_level(logging.INFO, logger="gradsync_core"):
        _torch_save(path)
    _check(_messages(caplog), path, "torch (torch.optim.AdamW), step 1, world size 1")


def test_a_jax_save_logs_its_progress_at_info(tmp_path, caplog) -> None:
    mesh = mesh_from_topology(Topology.create(2), sorted(jax.devices(), key=lambda d: d.id)[:2])
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    tx = shard_optimizer(optax.adamw(1e-3), mesh)
    path = str(tmp_path / "ckpt")
    with caplog.at_level(logging.INFO, logger="gradsync_core"):
        save_optimizer_state(path, tx, tx.init(params), params, step=7)
    _check(_messages(caplog), path, "jax (adamw), step 7, world size 2")


@pytest.mark.slow  # a fresh interpreter importing torch: about 10 s
def test_saves_are_silent_by_default(tmp_path) -> None:
    """No logging configured, as in a script: nothing on stderr (INFO is below the default
    WARNING threshold and gradsync adds no handler)."""
    script = textwrap.dedent(
        f"""
        import logging, torch
        from gradsync_torch.checkpoint.plain_save import save_plain
        net = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(net.parameters())
        net(torch.ones(1, 3)).sum().backward()
        opt.step()
        save_plain({str(tmp_path / "ckpt")!r}, net, opt)
        assert not logging.getLogger("gradsync_core").handlers
        assert not logging.getLogger({LOGGER!r}).handlers
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert os.path.isdir(tmp_path / "ckpt")
    assert done.returncode == 0, done.stderr
    assert done.stderr == "" and done.stdout == ""
