"""``PreemptionHandler`` in the core: SIGTERM only sets a flag, the ranks' flags and steps are
exchanged at each step boundary, ``exit()`` waits for the save and exits 143 (docs/design.md
§9). The executors' exchanges, with real signals to real rank groups, are tested in
tests/torch/test_preemption.py and tests/jax/test_async_multiprocess.py.
"""

from __future__ import annotations

import os
import signal

import pytest

from gradsync_core import PREEMPTED_EXIT
from gradsync_core.checkpoint import PreemptionHandler


def alone(mine: list[int]) -> list[list[int]]:
    """The exchange of one rank: its own row."""
    return [mine]


def test_sigterm_asks_for_a_save_at_the_next_boundary_and_the_handler_is_put_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionHandler(alone) as preemption:
        assert not preemption.should_save(0)
        os.kill(os.getpid(), signal.SIGTERM)  # the process lives on: only a flag is set
        assert preemption.signalled == signal.SIGTERM
        assert preemption.should_save(1)
        with pytest.raises(SystemExit) as exited:
            preemption.exit()
        assert exited.value.code == PREEMPTED_EXIT == 143
    assert signal.getsignal(signal.SIGTERM) == before


def test_one_signalled_rank_makes_every_rank_save() -> None:
    other = [[0, 5], [1, 5]]  # this rank, then a rank that was signalled
    with PreemptionHandler(lambda mine: other) as preemption:
        assert preemption.signalled is None and preemption.should_save(5)


def test_ranks_at_different_steps_are_refused() -> None:
    with PreemptionHandler(lambda mine: [mine, [1, mine[1] + 1]]) as preemption:
        with pytest.raises(ValueError, match=r"different steps on the ranks \(7, 8\)"):
            preemption.should_save(7)
