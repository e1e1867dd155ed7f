"""``gradsync checkpoint inspect PATH``: what a checkpoint holds, after checking every hash.

Standard library only: the per-rank sizes come from the safetensors headers
(``checkpoint._safetensors``, bounded) without reading any tensor. Works on checkpoints
written by either executor (docs/checkpoints.md).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from typing import Any

from gradsync_core.checkpoint._atomic import resolve_checkpoint
from gradsync_core.checkpoint._format import Manifest, rank_file
from gradsync_core.checkpoint._layout import LAYOUT, describe_layout
from gradsync_core.checkpoint._model_weights import MODEL_PARAM
from gradsync_core.checkpoint._safetensors import read_header
from gradsync_core.checkpoint._storage import read_manifest, reading_version
from gradsync_core.cli._interchange import add_interchange_parsers

_SHOWN_OWNERS = 4  # owners listed per rank in the text output (all of them in --json)


def _nbytes(entries: Mapping[str, Any]) -> int:
    try:
        return sum(int(e["data_offsets"][1]) - int(e["data_offsets"][0]) for e in entries.values())
    except (KeyError, TypeError, ValueError, IndexError):
        raise ValueError("a tensor entry has no valid data_offsets") from None


def summary(path: str, manifest: Manifest) -> dict[str, Any]:
    """The facts ``inspect`` prints, as JSON-ready data."""
    owners: dict[int, list[str]] = {r: [] for r in range(manifest.world_size)}
    for shard in manifest.plan.shards:
        if shard.stop > shard.start or manifest.plan.kind == "greedy":
            if shard.name not in owners[shard.rank]:
                owners[shard.rank].append(shard.name)
    ranks = []
    for rank in range(manifest.world_size):
        name = rank_file(rank, manifest.world_size)
        file = os.path.join(path, name)
        header, _ = read_header(file)
        model = {k: v for k, v in header.items() if k.startswith(MODEL_PARAM + "/")}
        state = {k: v for k, v in header.items() if k not in model}
        ranks.append(
            {
                "rank": rank,
                "file": name,
                "sha256": manifest.files[name],
                "bytes": os.path.getsize(file),
                "state_bytes": _nbytes(state),
                "model_bytes": _nbytes(model),
                "owners": owners[rank],
            }
        )
    return {
        "path": path,
        "format_version": manifest.version,
        "framework": manifest.framework,
        "optimizer": manifest.optimizer,
        "step": manifest.step,
        "world_size": manifest.world_size,
        "partition": manifest.plan.kind,
        "plan_fingerprint": manifest.plan.fingerprint,
        "params": len(manifest.params),
        "trainable": sum(p.requires_grad for p in manifest.params),
        "model_weights": len(manifest.extra.get("model", {})),
        "data": manifest.extra.get("data"),  # the sampler's cursor, if saved with data=
        "layout": manifest.extra.get(LAYOUT),  # what it was saved under, if recorded
        "ranks": ranks,
    }


def _position(data: Mapping[str, Any] | None) -> str:
    if data is None:
        return "not stored (saved without data=)"
    return (
        f"epoch {data['epoch']}, {data['consumed']} samples consumed (seed {data['seed']}, "
        f"dataset size {data['dataset_size']}, shuffle {data['shuffle']})"
    )


def _text(info: Mapping[str, Any]) -> str:
    lines = [
        f"Checkpoint {info['path']}: every file matches its sha256",
        f"  written by {info['framework']} ({info['optimizer']}), format version "
        f"{info['format_version']}, step {info['step']}, world size {info['world_size']}",
        f"  plan: {info['partition']}, fingerprint {info['plan_fingerprint']}",
        f"  parameters: {info['params']} ({info['trainable']} trainable); model weights: "
        + (f"{info['model_weights']} stored" if info["model_weights"] else "not stored"),
        "  data position: " + _position(info["data"]),
        "  saved under: " + describe_layout(info["layout"]),
        "",
        f"  {'rank':>4}  {'bytes':>12}  {'state':>12}  {'model':>12}  owners",
    ]
    for r in info["ranks"]:
        shown = ", ".join(r["owners"][:_SHOWN_OWNERS])
        more = len(r["owners"]) - _SHOWN_OWNERS
        shown += f", ... ({more} more)" if more > 0 else ""
        lines.append(
            f"  {r['rank']:>4}  {r['bytes']:>12,}  {r['state_bytes']:>12,}  "
            f"{r['model_bytes']:>12,}  {len(r['owners'])}: {shown}"
        )
    return "\n".join(lines)


def _inspect(args: argparse.Namespace) -> int:
    path = resolve_checkpoint(args.path)  # every file from one version, even mid-save
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a directory; pass a gradsync checkpoint directory")
    try:
        with reading_version(path):  # a later save that removes it: a sentence, load again
            manifest = read_manifest(path)  # the manifest's checksum and every file's sha256
            info = summary(path, manifest)
    except OSError as e:
        raise ValueError(f"cannot read checkpoint {path!r}: {e.strerror}") from None
    print(json.dumps(info, indent=1) if args.json else _text(info))
    return 0


def add_checkpoint_parser(sub: Any) -> None:
    """The ``checkpoint`` subcommand and its ``inspect`` action."""
    checkpoint = sub.add_parser(
        "checkpoint",
        help="inspect an optimizer checkpoint written by gradsync_torch or gradsync_jax",
        description="Work with gradsync checkpoints (docs/checkpoints.md).",
    )
    actions = checkpoint.add_subparsers(dest="action", required=True, parser_class=type(checkpoint))
    inspect = actions.add_parser(
        "inspect",
        help="verify every hash; print the writer, step, world size, plan and owners",
        description="Verify the manifest checksum and every rank file's sha256, then print "
        "the framework that wrote the checkpoint, its step, world size, plan fingerprint, "
        "and per rank the bytes and the parameters it owns. Exit 2 on a bad path or file.",
    )
    inspect.add_argument("path", metavar="PATH", help="the checkpoint directory")
    inspect.add_argument("--json", action="store_true", help="print JSON for machines")
    inspect.set_defaults(run=_inspect)
    add_interchange_parsers(actions)  # export --to / import --from dcp|orbax
