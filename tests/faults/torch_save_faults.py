"""Spawned workers of ``test_torch_save_faults.py``: ZeroRedundancyOptimizer saves that a
dying rank or a failing writer cuts short, and the loads that must then find the previous
checkpoint whole.

Every run trains the same 2-rank ZeRO-1 Adam beside a plain Adam fed the averaged gradients
(``Pair``, the unsharded reference), saves after ``SAVED_STEPS`` steps, trains
``MORE_STEPS`` more and saves again into the same path; the fault hits that second save.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import gradsync_core.checkpoint._atomic as atomic
from gradsync_core.checkpoint import save_hook
from gradsync_torch import ZeroRedundancyOptimizer
from tests.torch.zero_helpers import Pair, make_model, plain, zero

ADAM = {"lr": 1e-2}
SAVED_STEPS = 3
MORE_STEPS = 2
DIED = 17
_HOOKS = contextlib.ExitStack()  # the exit status of a rank killed on purpose

# Where a rank dies in the second save: (the rank, the save point it dies at; see
# gradsync_core.checkpoint.SAVE_POINTS).
KILL_POINTS: dict[str, tuple[int, str]] = {
    "before its rank file": (1, "before_file"),
    "after its rank file": (1, "after_file"),
    "before the manifest": (0, "before_manifest"),
    "before the switch": (0, "before_switch"),
    "after the switch": (0, "after_switch"),
}
# Which checkpoint a load finds afterwards: the previous one, except once the switch is done.
STEPS_AFTER_KILL = {
    point: SAVED_STEPS + MORE_STEPS if point == "after the switch" else SAVED_STEPS
    for point in KILL_POINTS
}


def _pair(world_size: int) -> Pair:
    return Pair(world_size, zero(torch.optim.Adam, **ADAM), plain(torch.optim.Adam, **ADAM))


def _die_at(rank: int, point: str) -> None:
    """Patch this process so that ``rank`` exits (no clean-up, like SIGKILL) at ``point``."""
    dying, save_point = KILL_POINTS[point]
    if rank != dying:
        return
    # Never closed (and kept referenced, or collecting it would close it): the process exits
    # at the point.
    _HOOKS.enter_context(save_hook(save_point, lambda: os._exit(DIED)))


def crash_during_save(rank: int, world_size: int, path: str, point: str) -> dict[str, Any]:
    """Save, train on, and die at ``point`` of the next save. The surviving rank returns
    what it raised and how long it took to notice."""
    run = _pair(world_size)
    for _ in range(SAVED_STEPS):
        run.step()
    run.opt.save(path)
    for _ in range(MORE_STEPS):
        run.step()
    _die_at(rank, point)
    start = time.monotonic()
    try:
        run.opt.save(path)
    except Exception as e:  # the peer is gone: gloo reports it (or the timeout does)
        return {"raised": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}
    return {"raised": None, "seconds": time.monotonic() - start}


def _disk_full(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _io_error(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.EIO, os.strerror(errno.EIO))


# Where a writer raises in a save, on which rank, and what every rank then reports: a save
# point (module None) or a function of a module replaced by one that raises.
RAISE_POINTS: dict[str, tuple[int, Any, str, Callable[..., Any], str]] = {
    "rank file (disk full)": (
        1,
        None,
        "before_file",
        _disk_full,
        r"rank 1 could not write its file: OSError: \[Errno 28\] No space left on device",
    ),
    "manifest (disk full)": (
        0,
        None,
        "before_manifest",
        _disk_full,
        r"\(rank 0\): OSError: \[Errno 28\] No space left on device",
    ),
    "fsync (I/O error)": (
        0,
        atomic,
        "fsync_directory",
        _io_error,
        r"\(rank 0\): OSError: \[Errno 5\] Input/output error",
    ),
    "switch (I/O error)": (
        0,
        None,
        "before_switch",
        _io_error,
        r"\(rank 0\): OSError: \[Errno 5\] Input/output error",
    ),
}


@contextlib.contextmanager
def _raising(rank: int, point: str) -> Iterator[str]:
    failing, module, name, replacement, message = RAISE_POINTS[point]
    if module is None:
        with save_hook(name, replacement) if rank == failing else contextlib.nullcontext():
            yield message
        return
    original = getattr(module, name)
    if rank == failing:
        setattr(module, name, replacement)
    try:
        yield message
    finally:
        setattr(module, name, original)


def _leftovers(path: str) -> list[str]:
    """The save directories beside ``path`` other than the one it links to."""
    parent, base = os.path.split(path)
    current = os.readlink(path)
    return sorted(n for n in os.listdir(parent) if n.startswith(f"{base}.") and n != current)


def _check_loads(path: str, steps: int, reference: dict[str, Any]) -> None:
    """A fresh optimizer (with a wrong learning rate) loads ``path``: its state equals the
    plain Adam's after ``steps`` steps bitwise, its step count and learning rate are restored."""
    model = make_model()
    opt = ZeroRedundancyOptimizer(model.named_parameters(), torch.optim.Adam, lr=5.0)
    opt.load(path)
    assert opt.steps == steps, f"{path}: loaded step {opt.steps}, expected {steps}"
    assert opt.param_groups[0]["lr"] == ADAM["lr"]
    opt.consolidate_state_dict(to=0)
    if dist.get_rank() != 0:
        return
    got = opt.state_dict()["state"]
    assert sorted(got) == sorted(reference["state"])
    for index, state in reference["state"].items():
        assert sorted(got[index]) == sorted(state), index
        for key, value in state.items():
            assert torch.equal(got[index][key], value), f"{path}: state {index} {key} differs"


def check_after_faults(
    rank: int, world_size: int, killed: dict[str, str], directory: str
) -> dict[str, Any]:
    """Load what the killed saves left (``killed``: point -> path); raise in the writer at
    every point of ``RAISE_POINTS`` and load again; then save over everything once more.
    Returns the message each raise point gave, and the kinds of save directories (``tmp-``,
    ``v-``) each killed save left beside its path before the next save removed them."""
    run = _pair(world_size)
    references = {}
    for _ in range(SAVED_STEPS):
        run.step()
    references[SAVED_STEPS] = copy.deepcopy(run.ref.state_dict())
    path = os.path.join(directory, "raised")
    run.opt.save(path)
    for _ in range(MORE_STEPS):
        run.step()
    references[SAVED_STEPS + MORE_STEPS] = copy.deepcopy(run.ref.state_dict())

    left = {}
    for point, dead_path in killed.items():
        steps = STEPS_AFTER_KILL[point]
        _check_loads(dead_path, steps, references[steps])
        base = os.path.basename(dead_path)
        left[point] = [n[len(base) + 1 :].partition("-")[0] + "-" for n in _leftovers(dead_path)]

    messages = {}
    for point in RAISE_POINTS:
        with (
            _raising(rank, point) as message,
            pytest.raises(ValueError, match=r"cannot save optimizer checkpoint .*" + message) as e,
        ):
            run.opt.save(path)
        messages[point] = str(e.value)
        _check_loads(path, SAVED_STEPS, references[SAVED_STEPS])
        assert _leftovers(path) == [], f"{point}: the failed save left {_leftovers(path)}"
        # The leader opens a save's staging directory as it prepares, before the ranks agree
        # (docs/design-checkpoints.md): every rank ends this check before the next save.
        dist.barrier()

    # The next save over each path succeeds and removes what the crashed saves left.
    final = SAVED_STEPS + MORE_STEPS
    for save_path in [path, *killed.values()]:
        run.opt.save(save_path)
        assert _leftovers(save_path) == [], f"{save_path}: {_leftovers(save_path)} left"
        _check_loads(save_path, final, references[final])
    return {"messages": messages, "left by the killed saves": left}
