"""Run as a script, one process per rank, by ``test_async_torch_faults.py``: train, save with
``blocking=False`` and let the interpreter exit with the save in flight (no ``wait()``, no
``destroy_process_group``), its writer slowed so that the exit comes first.

    python tests/faults/async_exit_worker.py RANK WORLD STORE PATH ok|fail

``ok``: the save must still complete (the process exits 0); ``fail``: rank 1's write fails
with a full disk, and every rank must exit with ``SAVE_FAILED_EXIT`` and say why on stderr.
Rank 0 writes the reference state at the save to ``PATH.npz``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np
import torch
import torch.distributed as dist

from gradsync_core.checkpoint import save_hook
from tests.torch.async_save_checks import pair, reference_state

_HOOKS = contextlib.ExitStack()  # never closed (collecting a hook would remove it)


def _slow_writer(fail: bool) -> None:
    time.sleep(1.0)  # the main thread has returned by now: the interpreter is exiting
    if fail:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def main(rank: int, world_size: int, store: str, path: str, mode: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size
    )
    run = pair(world_size)
    for _ in range(3):
        run.step()
    if rank == 0:
        np.savez(f"{path}.npz", **reference_state(run))
    _HOOKS.enter_context(
        save_hook("before_file", lambda: _slow_writer(mode == "fail" and rank == 1))
    )
    run.opt.save(path, blocking=False)
    print(f"rank {rank}: returned", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
