"""Run as a script, one process per rank, by ``test_preemption.py``: train a 2-rank ZeRO-1
Adam under a ``PreemptionHandler`` until SIGTERM arrives, then save at the next step
boundary with ``blocking=False`` and exit.

    python tests/torch/preemption_worker.py RANK WORLD STORE PATH

Each rank prints ``training`` once it trains and ``saving at step N`` when it saves; rank 0
writes the reference state at the save to ``PATH.npz``.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np
import torch
import torch.distributed as dist

from gradsync_torch import PreemptionHandler
from tests.torch.async_save_checks import pair, reference_state


def main(rank: int, world_size: int, store: str, path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size
    )
    run = pair(world_size)
    with PreemptionHandler() as preemption:
        for step in range(100_000):
            run.step()
            time.sleep(0.01)  # a step that takes a while: the signal lands inside one
            if step == 2:
                print("training", flush=True)
            if preemption.should_save(step):
                print(f"saving at step {step}", flush=True)
                if rank == 0:
                    np.savez(f"{path}.npz", **reference_state(run))
                run.opt.save(path, blocking=False)
                preemption.exit()
    sys.exit("never preempted")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
