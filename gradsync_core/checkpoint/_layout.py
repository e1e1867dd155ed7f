"""The layout a checkpoint was saved under, as its manifest records it (``extra["layout"]``).

A checkpoint that crosses layouts (``_boxes``) stores model space only, so nothing in its files
depends on the layout; the manifest still says where it came from: the topology's axis sizes,
the pipeline schedule and microbatches, the framework and the model's config, for
``gradsync checkpoint inspect`` and for a user picking the next layout. Older checkpoints have
no record and stay readable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradsync_core.plan._topology import Topology

LAYOUT = "layout"  # the manifest's extra key


def layout_record(
    topology: Topology,
    *,
    framework: str,
    schedule: str | None = None,
    microbatches: int | None = None,
    model: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON a save puts in ``extra["layout"]``.

    Args:
        topology: the axis sizes the ranks trained under.
        framework: ``"torch"`` or ``"jax"``.
        schedule, microbatches: the pipeline's, when ``topology.pp > 1``.
        model: the model's config (JSON values), e.g. ``dataclasses.asdict(config)``.

    Example:
        >>> layout_record(Topology.create(4, tp=2), framework="torch")["topology"]["tp"]
        2
    """
    record: dict[str, Any] = {"framework": framework, "topology": topology.to_json()}
    if topology.pp > 1:
        record["schedule"], record["microbatches"] = schedule, microbatches
    if model is not None:
        record["model"] = dict(model)
    return record


def check_layout_record(value: Any) -> None:
    """Refuse a layout record that is not a JSON object or whose topology does not parse.

    Raises:
        ValueError: naming the field.
    """
    if not isinstance(value, Mapping):
        raise ValueError(f"manifest field 'extra.layout' is {value!r:.80}, expected an object")
    if "topology" in value:
        try:
            Topology.from_json(value["topology"])
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(
                f"manifest field 'extra.layout.topology' is not a topology as "
                f"Topology.to_json writes it ({e})"
            ) from None


def describe_layout(value: Mapping[str, Any] | None) -> str:
    """One line for ``gradsync checkpoint inspect``: the axes above 1 and the schedule.

    Example:
        >>> describe_layout(layout_record(Topology.create(8, tp=2, pp=2), framework="torch",
        ...     schedule="1F1B", microbatches=2))
        'torch, dp 2 x tp 2 x pp 2 (8 ranks), pipeline 1F1B with 2 microbatches'
    """
    if not value:
        return "not recorded (saved by a save that does not record it)"
    text = str(value.get("framework", "?"))
    if "topology" in value:
        topo = Topology.from_json(value["topology"])
        dp = [("dp_replicate", topo.dp_replicate), ("dp_shard", topo.dp_shard)]
        sizes = [*(dp if topo.hsdp else [("dp", topo.dp)]), ("cp", topo.cp), ("tp", topo.tp)]
        sizes += [("ep", topo.ep), ("pp", topo.pp)]
        axes = " x ".join(f"{axis} {size}" for axis, size in sizes if size > 1)
        text += f", {axes or '1 process'} ({topo.world_size} ranks)"
    if value.get("schedule"):
        text += f", pipeline {value['schedule']} with {value.get('microbatches')} microbatches"
    return text
