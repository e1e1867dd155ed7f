"""XLA options the JAX tests compile with."""

from __future__ import annotations

# LLVM's optimization level 0 for the tests' large programs (the optimizer sweeps' sharded and
# unsharded steps, the pipelined programs): XLA's own passes (fusion, layout, collectives) run
# as usual and no fast-math is enabled at any level, so what is compared is the same
# arithmetic; only the machine code is left unoptimized (the sweep's unsharded reference of
# about 100 optimizers: 9.9 s -> 8.1 s to compile; a pipelined program about twice as fast).
FAST_COMPILE = {"xla_backend_optimization_level": 0}
