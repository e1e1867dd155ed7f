"""Named points of a save where a test may inject a fault (docs/design.md §15).

The fault tests kill a rank, or make a write fail, at each step of the switching save. They
used to patch private functions by name, which a rename silently broke; these names are the
contract instead. ``run_hook(point)`` is called by the save at each point; it costs one dict
lookup when nothing is registered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

# In the order a save reaches them: each rank file (before and after it is written), the
# manifest (leader), the switch of PATH to the new version, and the removal of the
# superseded versions once PATH names the new one.
SAVE_POINTS = ("before_file", "after_file", "before_manifest", "before_switch", "after_switch")

_hooks: dict[str, list[Callable[[], None]]] = {point: [] for point in SAVE_POINTS}


def run_hook(point: str) -> None:
    """Run the actions registered at ``point`` (none outside tests)."""
    for action in list(_hooks[point]):
        action()


@contextlib.contextmanager
def save_hook(point: str, action: Callable[[], None]) -> Iterator[None]:
    """Run ``action`` whenever a save reaches ``point`` (one of ``SAVE_POINTS``), while the
    context is open; an exception ``action`` raises is the save's failure at that point.

    Raises:
        ValueError: if ``point`` is not one of ``SAVE_POINTS``.
    """
    if point not in _hooks:
        raise ValueError(f"save point {point!r} is not one of {list(SAVE_POINTS)}")
    _hooks[point].append(action)
    try:
        yield
    finally:
        _hooks[point].remove(action)
