"""The ``gradsync`` command line, a layer above the planners and the checkpoint format.

It names no executor: the commands that need a framework (a live ``--model``, ``checkpoint
export`` / ``import``) find the executors' converters through the entry points they declare
(``_plugins``). One module per command: ``plan`` (``_main``, with ``_zero`` and ``_pipeline``
for its ZeRO and pipeline sections), ``checkpoint`` (``_checkpoint``, ``_interchange``), the
shared output helpers (``_json``, ``_table``) and the live model reader (``_model``).
"""

from gradsync_core.cli._main import main

__all__ = ["main"]
