"""What the Flax examples share: one training run that can stop, be saved and continue.

Beside the examples (not gradsync API). A run is its settings (total steps, batch, learning
rate, clip) plus where it stands; ``--save`` writes the settings beside the checkpoint
(``run.json``) and ``--resume`` reads them back, so the resumed run continues the same
learning-rate schedule over the same total steps. Batches are a function of the global step,
so a resumed run draws the batches an uninterrupted run would draw next.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

RUN_FILE = "run.json"
FEATURES = 16
SETTINGS = ("steps", "batch", "lr", "clip")


def batch(step: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch of global step ``step``: a smooth target the MLPs can fit."""
    w_true = np.random.default_rng(0).normal(size=(FEATURES, 1)).astype(np.float32) / 4
    x = np.random.default_rng((1, step)).normal(size=(size, FEATURES)).astype(np.float32)
    return x, np.sin(x @ w_true)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a resumable run."""
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices")
    parser.add_argument("--partition", choices=("auto", "greedy", "flat"), default="auto")
    parser.add_argument("--steps", type=int, default=None, help="total steps (default 200)")
    parser.add_argument("--stop", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--batch", type=int, default=256, help="global batch size")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--clip", type=float, default=None, help="global-norm clip")
    parser.add_argument("--save", default=None, help="save the training state here")
    parser.add_argument("--resume", default=None, help="continue the run saved here")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest relative diff")


def resolve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Fill ``args.start``/``args.stop`` and, on a resume, the saved run's settings.

    A setting given on the command line that differs from the saved run's is refused: the
    run would no longer be the one that was saved.
    """
    args.start = 0
    if args.resume:
        with open(os.path.join(args.resume, RUN_FILE)) as f:
            saved = json.load(f)
        for name in SETTINGS:
            given = getattr(args, name)
            if given is None or given == parser.get_default(name):
                setattr(args, name, saved[name])
            elif given != saved[name]:
                parser.error(
                    f"--{name} {given} differs from the saved run's {saved[name]}; leave it "
                    "out to continue the saved run"
                )
        args.start = saved["stopped_at"]
    args.steps = 200 if args.steps is None else args.steps
    default_stop = args.steps // 2 if args.save and not args.resume else args.steps
    args.stop = default_stop if args.stop is None else args.stop
    if not args.start < args.stop <= args.steps:
        parser.error(f"--stop {args.stop} must lie in ({args.start}, {args.steps}]")
    return args


def write_run(args: argparse.Namespace) -> None:
    """The settings a resume must reuse, written after the checkpoint (which replaces the
    directory once complete)."""
    run = {name: getattr(args, name) for name in SETTINGS} | {"stopped_at": args.stop}
    with open(os.path.join(args.save, RUN_FILE), "w") as f:
        json.dump(run, f)


def report(example: str, args, losses, reference, ours, theirs, baseline: str) -> None:
    """Print the baseline and the largest relative loss and parameter differences from it,
    then one JSON line; exit 1 above ``args.tolerance``.

    ``ours``/``theirs``: matching lists of parameter arrays.
    """
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
    param_diff = max(
        float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(ours, theirs, strict=True)
    )
    print(f"baseline: {baseline}")
    print(f"largest relative loss difference from the baseline: {loss_diff:.2e}")
    print(f"largest relative parameter difference from the baseline: {param_diff:.2e}")
    summary = {
        "example": example,
        "partition": args.partition,
        "start": args.start,
        "stop": args.stop,
        "steps": args.steps,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "loss_diff": loss_diff,
        "param_diff": param_diff,
    }
    print(json.dumps(summary))
    if max(loss_diff, param_diff) > args.tolerance:
        sys.exit(f"differs from {baseline} by {max(loss_diff, param_diff):.2e}")


def state_sizes(per_device: int, unsharded: int, devices: int, parameters: int) -> str:
    """The optimizer state per device against the unsharded state and the ideal 1/devices."""
    return (
        f"{parameters:,} parameters; optimizer state per device {per_device:,} bytes of "
        f"{unsharded:,} unsharded ({per_device / unsharded:.1%}; 1/{devices} = {1 / devices:.1%})"
    )
