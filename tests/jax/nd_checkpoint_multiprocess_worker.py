"""Worker of the cross-layout pair saved by several JAX processes:
``python nd_checkpoint_multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR``.

Each of the 2 processes owns 4 CPU devices of an 8-device ``jax.distributed`` job on
127.0.0.1; together they train the Llama reference of nd_checkpoint_problem.py ``SAVED``
steps under dp_shard 2 x tp 2 (x dp_replicate 2, ``examples/llama_nnx.py``'s
``parallelize`` on the job's global mesh) and save it (``ParallelLlama.save``: each process
writes its own devices' rank files) to ``OUT_DIR/dp_shard2_tp2``. The test loads it in one
process under another layout and continues (tests/jax/test_nd_checkpoint.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.jax.distributed_start import start_process


def main(process_id: int, num_processes: int, port: int, out_dir: str) -> None:
    start_process(process_id, num_processes, port, local_devices=8 // num_processes)
    import jax
    import numpy as np

    from tests.jax.nd_checkpoint_problem import SAVED, build, initial_params, sampler, train

    assert jax.device_count() == 8 and jax.local_device_count() == 8 // num_processes
    par = build("dp_shard2_tp2")
    stored = par.place(jax.tree.map(np.asarray, initial_params()))
    stored, state = train(par, stored, par.init(stored), range(SAVED))
    data = sampler()
    for _ in range(SAVED):
        next(data)
    par.save(Path(out_dir) / "dp_shard2_tp2", stored, state, step=SAVED, data=data)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
