"""Canonical JSON and fingerprints shared by every plan (docs/design.md §8)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

PLAN_VERSION = 1


def canonical_json(obj: Any) -> str:
    """One spelling per value: sorted keys, no whitespace, ASCII only."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def fingerprint(obj: Any) -> str:
    """sha256 of the canonical JSON, hex."""
    return hashlib.sha256(canonical_json(obj).encode("ascii")).hexdigest()


def check_header(obj: Mapping[str, Any], kind: str) -> None:
    """Reject JSON that is not a ``kind`` plan of a version this code reads."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"expected a JSON object for a {kind}, got {type(obj).__name__}")
    if obj.get("kind") != kind:
        raise ValueError(f"expected a {kind!r} plan, got kind {obj.get('kind')!r}")
    if obj.get("version") != PLAN_VERSION:
        raise ValueError(
            f"{kind} has version {obj.get('version')!r}; this gradsync reads version "
            f"{PLAN_VERSION}: re-create the plan with this version"
        )
