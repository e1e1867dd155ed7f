"""Data parallelism: the ``DataParallel`` wrapper, its bucket reducer and ZeRO-2's sharder."""
