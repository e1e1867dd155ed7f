"""``gradsync plan --json``: one versioned report with named fields over the canonical plans.

The canonical plans (``to_json``) stay as they are, compact and positional, because their bytes
are what fingerprints hash and checkpoints store. A reader of the report gets the same facts by
name: one record per bucket slot and one per owner piece, so no one has to remember that the
third entry of ``["embed.weight", 0, 0, 32768000, 0]`` is ``start``.
"""

from __future__ import annotations

from typing import Any

from gradsync_core.plan._buckets import BucketPlan
from gradsync_core.plan._shards import ShardPlan
from gradsync_core.plan._topology import Topology

REPORT_KIND = "plan_report"
# 2: named "slots" and "owners" records beside the canonical plans (1 had the plans only).
REPORT_VERSION = 2


def report_header() -> dict[str, Any]:
    """What every ``--json`` report starts with: its kind and version."""
    return {"kind": REPORT_KIND, "version": REPORT_VERSION}


def named_slots(plan: BucketPlan) -> list[dict[str, Any]]:
    """Every bucket slot as ``{bucket, name, shape, offset}`` (offset: elements from the
    bucket's start), bucket 0 (reduced first) first."""
    return [
        {"bucket": index, "name": s.name, "shape": list(s.shape), "offset": s.offset}
        for index, bucket in enumerate(plan.buckets)
        for s in bucket.slots
    ]


def named_owners(plan: ShardPlan) -> list[dict[str, Any]]:
    """Every owner piece as ``{name, rank, start, stop, group}``: ``rank`` owns elements
    ``[start, stop)`` of the flattened parameter ``name``; ``group`` is its param group."""
    return [
        {"name": s.name, "rank": s.rank, "start": s.start, "stop": s.stop, "group": s.group}
        for s in plan.shards
    ]


def plan_report(
    buckets: BucketPlan, shards: ShardPlan, topo: Topology, expert_shards: ShardPlan | None
) -> dict[str, Any]:
    """The ``--json`` report of ``gradsync plan`` without ``--zero``."""
    out = report_header() | {
        "buckets": buckets.to_json(),
        "shards": shards.to_json(),
        "topology": topo.to_json(),
        "slots": named_slots(buckets),
        "owners": named_owners(shards),
        "fingerprints": {
            "buckets": buckets.fingerprint,
            "shards": shards.fingerprint,
            "topology": topo.fingerprint,
        },
    }
    if expert_shards is not None:  # absent without experts
        out["expert_shards"] = expert_shards.to_json()
        out["expert_owners"] = named_owners(expert_shards)
        out["fingerprints"]["expert_shards"] = expert_shards.fingerprint
    return out
