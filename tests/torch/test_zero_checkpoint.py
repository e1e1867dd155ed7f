"""Resharding checkpoints of gradsync_torch.ZeroRedundancyOptimizer.

The spawned checks (save, resume, reshard, damaged checkpoints) are in
``zero_checkpoint_checks.py`` and run inside the world-size workers of ``test_zero.py``; the
tests in this file check the pure state helpers without processes.
"""

from __future__ import annotations

import pytest
import torch

from gradsync_torch._optim_state import StatePiece, assemble
from gradsync_torch.checkpoint.saved_keys import probe_state_keys
from gradsync_torch.zero.broadcast import Piece
from gradsync_torch.zero.state import slice_state


def test_assemble_joins_flat_slices_and_keeps_whole_state() -> None:
    exp_avg = torch.arange(6.0).view(2, 3)
    step = torch.tensor(4.0)
    pieces = [
        StatePiece(1, 4, 6, False, {"exp_avg": exp_avg.view(-1)[4:6], "step": step}),
        StatePiece(1, 0, 4, False, {"exp_avg": exp_avg.view(-1)[0:4], "step": step}),
        StatePiece(0, 0, 3, True, {"exp_avg": torch.ones(3), "step": step}),
    ]
    full = assemble(pieces, [(3,), (2, 3)])
    assert torch.equal(full[1]["exp_avg"], exp_avg) and full[1]["step"] is step
    assert torch.equal(full[0]["exp_avg"], torch.ones(3))
    with pytest.raises(
        ValueError, match=r"cover elements up to 4 of 6 without a gap or overlap: .* do not tile"
    ):
        assemble(pieces[1:2], [(3,), (2, 3)])


def test_slice_state_cuts_elementwise_state_only() -> None:
    piece = Piece(index=0, group=0, start=2, stop=5, tensor=torch.zeros(3), whole=False)
    state = {"exp_avg": torch.arange(6.0).view(2, 3), "step": torch.tensor(1.0)}
    out = slice_state(state, piece, (2, 3))
    assert torch.equal(out["exp_avg"], torch.tensor([2.0, 3.0, 4.0]))
    assert out["step"].item() == 1.0
    with pytest.raises(ValueError, match="cannot be sharded by element ranges"):
        slice_state({"row": torch.zeros(2)}, piece, (2, 3))


def test_probe_learns_the_keys_an_optimizer_keeps() -> None:
    """What the load-time key check compares a torch manifest's state keys with."""
    adam = ("exp_avg", "exp_avg_sq", "step")
    assert probe_state_keys(torch.optim.Adam, {"lr": 1e-3}) == adam
    assert probe_state_keys(torch.optim.Adam, {"amsgrad": True}) == tuple(
        sorted((*adam, "max_exp_avg_sq"))
    )
    assert probe_state_keys(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}) == ("momentum_buffer",)
    assert probe_state_keys(torch.optim.SGD, {"lr": 0.1}) == ()
    assert probe_state_keys(torch.optim.LBFGS, {}) is None  # needs a closure: not probed
