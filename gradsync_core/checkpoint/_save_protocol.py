"""The switching save, written once for every executor (docs/design.md §9).

A checkpoint save is a collective: every rank (torch) or process (JAX) writes its own rank
files, one leader writes the manifest and switches ``PATH`` to the new version. Whatever the
framework, the steps are the same, and so are the hazards: a rank that fails while the others
walk on into the next collective hangs the job, and a manifest written before every file is
complete loses data. ``run_save`` takes the ranks through the steps together:

1. every rank prepares its files (a failure is held, not raised); the leader opens
   ``PATH.tmp-<token>`` (``begin_save``);
2. all agree that every rank prepared, the leader's token travelling with the answers (if a
   rank failed, the leader removes the directory it opened);
3. every rank writes and hashes its files there; all agree that every write worked, every
   rank's digests and record (what the manifest needs from it) travelling with the answers;
4. the leader writes the manifest and switches ``PATH`` (``commit_save``), or removes the
   staging directory (``discard_save``) on failure; all agree on the outcome.

Three agreements, each one ``SaveAgreement.gather`` of every rank's error, name and what it
shares, and no other collective: a save in the background pays each one in a wake-up of its
thread, and the training in waiting for the interpreter lock (torch's gather is one
all-gather while the answers are small, so a save runs three collectives).

Each executor implements ``SaveAgreement`` on its own collectives (torch: a process group,
JAX: ``jax.distributed`` processes) and gives ``SaveSteps``, its framework part. A failed save
raises ``CheckpointError`` on every rank, with the same sentence, naming the rank that failed;
on the failing rank the original exception is its ``__cause__``.

Fault injection: ``save_hook(point, action)`` runs ``action`` at one of ``SAVE_POINTS``, so
the fault tests kill or fail a save at a named step instead of patching private functions.

Saves that do not stop training (``start_save``, an executor's ``blocking=False``): step 1
runs in the caller's thread and copies this rank's bytes into host staging buffers; steps 2
to 4 run in a background thread (``_background``: at most one save in flight per process,
its failure raised at ``wait()``, the next save or exit); an executor's ``write_files`` may
hand the bytes to the writer process (``write_staged_rank_file``), out of the training's
interpreter. That thread agrees over
collectives of its own, never the training's: the executor gives ``start_save`` an
agreement on a separate group (torch: a gloo group made for it; JAX: the distributed
client's key-value store), so its collectives cannot interleave with training's. A failure
to prepare on one rank is held and becomes step 1's agreed failure, in the background.

Progress: the leader logs each save's start, its steps and its end (files, bytes, elapsed) at
INFO through ``logging`` (this module's logger, under ``gradsync_core``). No handler is
configured, so saves are silent unless the program asks, e.g.
``logging.basicConfig(level=logging.INFO)``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, Protocol, TypeVar

from gradsync_core.checkpoint._atomic import (
    begin_save,
    commit_save,
    discard_save,
    new_save_token,
    release_save,
)
from gradsync_core.checkpoint._atomic import staging_directory as _staging_directory
from gradsync_core.checkpoint._background import (
    SaveHandle,
    in_background,
    start_background,
    wait_for_saves,
)
from gradsync_core.checkpoint._format import Manifest
from gradsync_core.checkpoint._save_hooks import run_hook
from gradsync_core.checkpoint._storage import write_atomic, write_manifest

P = TypeVar("P")
_log = logging.getLogger(__name__)


class CheckpointError(ValueError, RuntimeError):
    """A checkpoint save or load failed; raised alike on every rank or process.

    Subclasses both ``ValueError`` (what ``gradsync_torch`` raised before) and ``RuntimeError``
    (what ``gradsync_jax`` raised on the processes that did not fail), so existing handlers
    of either keep working.
    """


class SaveAgreement(Protocol):
    """The collectives one save needs; each executor implements them on its own group.

    ``run_save`` agrees through ``gather`` alone; ``all_ok`` and ``share_token`` serve the
    executors' loads (the version every rank reads, a read that failed on one).
    """

    @property
    def leader(self) -> bool:
        """Whether this rank opens the staging directory and writes the manifest."""
        ...

    @property
    def who(self) -> str:
        """This rank as a sentence names it: ``"rank 1"``, ``"process 0"``."""
        ...

    def all_ok(self, error: str | None, what: str) -> None:
        """Raise ``CheckpointError("{what} (<who failed>): {error}")`` on every rank unless no
        rank failed (``error`` is this rank's failure, ``None`` when its step worked)."""
        ...

    def share_token(self, token: str | None) -> str:
        """The leader's save token, on every rank."""
        ...

    def gather(self, record: Any) -> list[Any]:
        """Every rank's JSON-able ``record``, in rank order, on every rank."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveSteps(Generic[P]):
    """An executor's framework part of one save.

    ``prepare()`` builds this rank's tensors (anything ``P``); ``write_files(prepared,
    staging)`` writes this rank's rank files into ``staging`` and returns ``{rank: sha256}``
    for each (``write_rank_file`` does one); ``record(prepared)`` is the JSON-able data the
    manifest needs from this rank; ``manifest(prepared, files, records)`` builds the manifest
    from every rank file's digest and every rank's record.
    """

    prepare: Callable[[], P]
    write_files: Callable[[P, str], Mapping[int, str]]
    manifest: Callable[[P, dict[int, str], list[Any]], Manifest]
    record: Callable[[P], Any] = lambda prepared: None


def error_message(error: BaseException) -> str:
    """One sentence for a failure: a ``ValueError``'s own words, else ``"Type: words"``."""
    return f"{error}" if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"


def write_rank_file(staging: str, name: str, data: bytes | Sequence[Any]) -> str:
    """Write one rank file atomically into ``staging``; return its sha256 (hex).

    ``data``: its bytes, or the chunks ``tensor_file`` makes (hashed as they are written).
    """
    run_hook("before_file")
    digest = hashlib.sha256()
    write_atomic(os.path.join(staging, name), data, digest=digest)
    run_hook("after_file")
    return digest.hexdigest()


class _Step:
    """Runs one step of a save: holds a local failure until every rank has been asked, in one
    ``gather`` that also carries what the step gives the others (one round, not two)."""

    def __init__(self, agreement: SaveAgreement, what: str) -> None:
        self.agreement, self.what = agreement, what

    def __call__(
        self,
        action: Callable[[], Any],
        *,
        run: bool = True,
        label: str = "",
        share: Callable[[Any], Any] = lambda result: None,
    ) -> tuple[Any, list[Any]]:
        """Run ``action`` (here if ``run``), then agree: every rank's error, with its
        ``share(result)`` (JSON-able; ``None`` on a rank that failed), is gathered.

        Returns:
            ``action``'s result and every rank's shared value, in rank order.

        Raises:
            CheckpointError: ``"{what} (<first rank that failed>): {label}{its error}"`` on
                every rank when any failed (here, the original is its ``__cause__``); an
                interrupt (not an ``Exception``) raised here as it is, once the others know.
        """
        result, shared, error = None, None, None
        if run:
            try:
                result = action()
                shared = share(result)
            # Held until every rank knows; a KeyboardInterrupt too: raised at once, it would
            # leave the other ranks waiting for this one until the process-group timeout.
            except BaseException as e:
                error = e
        message = None if error is None else f"{label}{error_message(error)}"
        answers = self.agreement.gather(
            {"error": message, "who": self.agreement.who, "shared": shared}
        )
        failed = [answer for answer in answers if answer["error"] is not None]
        if failed:
            if error is not None and not isinstance(error, Exception):
                raise error from None  # the others know now: an interrupt stays one here
            where = f" ({failed[0]['who']})" if len(answers) > 1 else ""
            raise CheckpointError(f"{self.what}{where}: {failed[0]['error']}") from error
        return result, [answer["shared"] for answer in answers]


def run_save(
    path: str | os.PathLike[str], agreement: SaveAgreement, steps: SaveSteps[P], *, what: str
) -> Manifest:
    """Save a checkpoint at ``path`` with the switching protocol (a collective).

    Three agreements, each one ``agreement.gather``: every rank prepared (and the leader
    opened the staging directory: its token travels with the answers); every rank wrote its
    files (their digests and its record travel with the answers); the leader switched.

    Args:
        path: the checkpoint path (a link to the newest complete version once saved).
        agreement: the executor's collectives over the ranks that save together.
        steps: the executor's framework part.
        what: the failure's subject, e.g. ``"cannot save optimizer checkpoint ckpt/opt"``.

    Returns:
        The manifest written, on every rank.

    Raises:
        CheckpointError: on every rank when any rank failed any step; ``path`` then still
            names the previous checkpoint. Also a save in the background that failed before
            this one and was not yet raised (this save then does not start).
    """
    if not in_background():
        wait_for_saves()  # at most one save in flight; its failure is raised here
    start = time.monotonic()
    if agreement.leader:
        _log.info("saving checkpoint %s", os.fspath(path))
    step = _Step(agreement, what)
    opened: list[str] = []  # the leader's staging directory, once it exists

    def prepare() -> tuple[P, str | None]:
        prepared = steps.prepare()  # nothing on disk has changed yet
        if not agreement.leader:
            return prepared, None
        token = new_save_token()
        begin_save(path, token)
        opened.append(_staging_directory(path, token))
        return prepared, token

    # The agreement also orders the staging directory's creation before any rank writes
    # into it. A rank that failed to prepare: the leader removes the directory it opened.
    try:
        (prepared, _), answers = step(prepare, share=lambda result: result[1])
    except BaseException:
        if opened:
            discard_save(opened[0])
        raise
    (token,) = [answer for answer in answers if answer is not None]  # the leader's
    staging = _staging_directory(path, token)
    if agreement.leader:
        _log.info(
            "checkpoint %s: state prepared in %.2f s; writing into %s",
            os.fspath(path),
            time.monotonic() - start,
            staging,
        )
    try:
        return _write_and_commit(path, staging, agreement, steps, prepared, step, start)
    finally:
        # Whatever happened (a collective broken by a dead rank included), this save is over:
        # what it left behind is abandoned now, and a later save removes it.
        if agreement.leader:
            release_save(staging)


def _write_and_commit(
    path: str | os.PathLike[str],
    staging: str,
    agreement: SaveAgreement,
    steps: SaveSteps[P],
    prepared: P,
    step: _Step,
    start: float,
) -> Manifest:
    """Steps 3 and 4 of ``run_save``: write and hash, gather, write the manifest and switch;
    ``start`` is the save's ``time.monotonic()`` at its start, for the log."""
    try:
        _, gathered = step(
            lambda: dict(steps.write_files(prepared, staging)),
            label=f"{agreement.who} could not write its file: ",
            share=lambda written: {"files": written, "record": steps.record(prepared)},
        )
    except CheckpointError:
        # Every rank knows the save failed: the leader removes what it staged. When a
        # collective itself breaks (a rank died), the staging directory stays: it is never
        # read, and once ``run_save`` dropped its save lock a later save removes it.
        if agreement.leader:
            discard_save(staging)
        raise
    nbytes = 0
    if agreement.leader:  # every rank's files are complete in ``staging`` now, and only they
        nbytes = sum(entry.stat().st_size for entry in os.scandir(staging) if entry.is_file())
        _log.info(
            "checkpoint %s: every rank wrote its files, %d bytes, in %.2f s",
            os.fspath(path),
            nbytes,
            time.monotonic() - start,
        )
    files = {int(rank): digest for g in gathered for rank, digest in g["files"].items()}
    records: Sequence[Any] = [g["record"] for g in gathered]

    def commit() -> Manifest:
        try:
            manifest = steps.manifest(prepared, files, list(records))
            if agreement.leader:
                run_hook("before_manifest")
                write_manifest(staging, manifest)
                commit_save(path, staging)
        except BaseException:
            if agreement.leader:
                discard_save(staging)
            raise
        return manifest

    manifest: Manifest
    manifest, _ = step(commit)  # nobody returns before the checkpoint is complete
    if agreement.leader:
        _log.info(
            "saved checkpoint %s: %s (%s), step %d, world size %d, %d rank files, %d bytes, "
            "in %.2f s",
            os.fspath(path),
            manifest.framework,
            manifest.optimizer,
            manifest.step,
            manifest.world_size,
            len(manifest.files),
            nbytes,
            time.monotonic() - start,
        )
    return manifest


def start_save(
    path: str | os.PathLike[str], agreement: SaveAgreement, steps: SaveSteps[P], *, what: str
) -> SaveHandle:
    """Start a save that does not stop training (a collective, like ``run_save``).

    Waits for the save in flight, if any (raising its failure); runs ``steps.prepare`` here
    (it copies this rank's bytes into staging buffers nothing else writes until the save
    ends), then ``run_save``'s other steps in a background thread, with ``agreement``, which
    must not share its collectives with training. A failure of ``prepare`` is held and
    agreed there, so it reaches every rank alike.

    Args:
        path: the checkpoint path.
        agreement: the collectives of the background thread.
        steps: the executor's framework part; ``prepare`` is called in this thread.
        what: the failure's subject.

    Returns:
        The save's handle (``wait()`` returns the manifest, on every rank).

    Raises:
        CheckpointError: the previous save in the background failed and was not yet raised.
    """
    wait_for_saves()
    held: BaseException | None = None
    prepared: Any = None
    try:
        prepared = steps.prepare()
    except BaseException as e:  # agreed in the background, so every rank hears of it
        held = e

    def prepare() -> Any:
        if held is not None:
            raise held
        return prepared

    background = replace(steps, prepare=prepare)
    handle = start_background(
        os.fspath(path),
        lambda: run_save(path, agreement, background, what=what),
        _as_failure(what, agreement.who),
    )
    if held is not None and not isinstance(held, Exception):
        raise held  # an interrupt stays one here; the others hear of it in the background
    return handle


def _as_failure(what: str, who: str) -> Callable[[BaseException], BaseException]:
    """How a background save keeps what ended it: an agreed ``CheckpointError`` as it is;
    anything else (a collective that broke because a rank died or the group was destroyed,
    an interrupt) as one sentence naming this rank, the original its cause."""

    def wrap(error: BaseException) -> BaseException:
        if isinstance(error, CheckpointError):
            return error
        failure = CheckpointError(f"{what} ({who}): {error_message(error)}")
        failure.__cause__ = error
        return failure

    return wrap


def start_agreed_save(
    path: str | os.PathLike[str], run: Callable[[], Any], *, what: str, who: str
) -> SaveHandle:
    """Start ``run()`` in a background thread as the save in flight, for an executor whose
    save is not ``run_save``'s steps (one rank writes what all gathered to it): ``run``
    writes, then agrees its outcome over collectives of its own, so that every rank's handle
    ends alike. Waits for the save in flight first (raising its failure).

    Args:
        path: the checkpoint path (the handle's name).
        run: the save's rest; it returns what ``wait()`` returns.
        what: the failure's subject, ``"cannot save ... checkpoint P"``.
        who: this rank, as errors name it (``"rank 1"``).

    Returns:
        The save's handle.

    Raises:
        CheckpointError: the previous save in the background failed and was not yet raised.
    """
    wait_for_saves()
    return start_background(os.fspath(path), run, _as_failure(what, who))
