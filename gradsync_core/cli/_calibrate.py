"""``gradsync calibrate``: measure this machine's collectives and write its machine profile.

The core names no executor: the measurement is the framework's, found through its
``gradsync.calibrate`` entry point (``_plugins``). torch times its process group's collectives
(under ``torchrun`` the job's ranks, NCCL on GPUs; otherwise gloo ranks it spawns here), JAX its
local devices inside ``shard_map``. The profile is JSON (``MachineProfile``, its own kind and
version), written to ``--output`` or printed (docs/cost-model.md).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from gradsync_core.cli._plugins import CALIBRATORS, calibrator

KIB = 1024
DEFAULT_SIZES_KIB = (16, 256, 1024, 4096, 16384)
MAX_SIZE_KIB = 1 << 20  # 1 GiB: beyond any bucket
MAX_REPEATS = 1000


def add_calibrate_parser(sub: Any) -> None:
    """The ``calibrate`` subcommand."""
    parser = sub.add_parser(
        "calibrate",
        help="measure this machine's collectives (latency and bus bandwidth) for the cost model",
        description="Time all-reduce, all-gather, reduce-scatter, broadcast and point-to-point "
        "over every group size of the world, fit latency + bytes / bus bandwidth (nccl-tests' "
        "bus-bandwidth factors) and write the machine profile as JSON (docs/cost-model.md). "
        "torch: under torchrun, the job's ranks; otherwise --world-size gloo ranks spawned "
        "here. jax: the local devices.",
    )
    parser.add_argument("--framework", choices=tuple(CALIBRATORS), default="torch")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks (torch without torchrun: gloo processes to spawn, default 2; jax: devices, "
        "default all)",
    )
    parser.add_argument(
        "--sizes-kib",
        default=",".join(map(str, DEFAULT_SIZES_KIB)),
        metavar="KIB,...",
        help=f"message sizes in KiB (default {','.join(map(str, DEFAULT_SIZES_KIB))})",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per size (median)")
    parser.add_argument("--name", default=None, help="the profile's name (default: the host)")
    parser.add_argument("--output", "-o", default=None, metavar="FILE", help="write it here")
    parser.set_defaults(run=_calibrate)


def _sizes(value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--sizes-kib takes comma-separated ints, got {value!r}") from None
    if len(set(sizes)) < 2 or not all(1 <= s <= MAX_SIZE_KIB for s in sizes):
        raise ValueError(
            f"--sizes-kib needs two different sizes or more, each from 1 to {MAX_SIZE_KIB:,} KiB; "
            f"got {value!r}"
        )
    return tuple(s * KIB for s in sizes)


def _calibrate(args: argparse.Namespace) -> int:
    sizes = _sizes(args.sizes_kib)
    if not 1 <= args.repeats <= MAX_REPEATS:
        raise ValueError(f"--repeats must be between 1 and {MAX_REPEATS}, got {args.repeats}")
    if args.world_size is not None and not 2 <= args.world_size <= 1024:
        raise ValueError(f"--world-size must be between 2 and 1024, got {args.world_size}")
    measure = calibrator(args.framework)
    profile = measure(world_size=args.world_size, sizes=sizes, repeats=args.repeats, name=args.name)
    if profile is None:  # a torchrun rank other than 0
        return 0
    text = json.dumps(profile.to_json(), indent=1, sort_keys=True)
    if args.output is None:
        print(text)
        return 0
    tmp = f"{args.output}.tmp"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, args.output)
    print(f"wrote {args.output}: {len(profile.links)} links; {profile.source}")
    return 0
