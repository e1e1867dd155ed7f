"""The ``gradsync`` command line, a layer above the planners and the checkpoint format.

It names no executor: the commands that need a framework (a live ``--model``, ``checkpoint
export`` / ``import``) find the executors' converters through the entry points they declare
(``_plugins``). One module per command or shared helper (docs/design-names-and-layout.md).
"""

from gradsync_core.cli._main import main

__all__ = ["main"]
