"""Saves in the background (``start_save``), framework-free: one save in flight, a failure
raised at ``wait()``, at the next save or at exit, never lost; rank files written from
buffers (docs/design.md §9, "Asynchronous saves").

The saver here is a real one-process save (the agreement of one rank, as JAX's with one
process): a rank file of float32 values taken from a ``bytearray`` that the "training" goes
on changing after ``start_save`` returned, hashed, the manifest, the switch. The torch and JAX
tests run the same protocol across ranks and processes.
"""

from __future__ import annotations

import array
import errno
import json
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gradsync_core import (
    CheckpointError,
    read_manifest,
    wait_for_saves,
)
from gradsync_core.checkpoint import (
    SAVE_FAILED_EXIT,
    WRITER_NICE,
    SaveSteps,
    TensorBytes,
    rank_file,
    read_header,
    run_save,
    save_hook,
    start_save,
    tensor_file,
    write_rank_file,
)
from tests.core.background_save_problem import Alone, value_save

ROOT = Path(__file__).resolve().parents[2]


def _floats(*values: float) -> bytearray:
    return bytearray(array.array("f", values).tobytes())


def _stored(path: Path) -> list[float]:
    """The values of ``w/exp_avg`` in the checkpoint ``path`` (after its hash check)."""
    read_manifest(path)
    header, start = read_header(path / rank_file(0, 1))
    begin, end = header["w/exp_avg"]["data_offsets"]
    data = (path / rank_file(0, 1)).read_bytes()[start + begin : start + end]
    return list(array.array("f", data))


@pytest.fixture(autouse=True)
def _no_save_left() -> Any:
    yield
    try:
        wait_for_saves()  # a test that failed midway leaves nothing for the next
    except CheckpointError:
        pass


def test_the_file_holds_the_state_at_the_call_while_training_changes_it(tmp_path: Path) -> None:
    values = _floats(1, 2, 3, 4)
    release = threading.Event()
    with save_hook("before_file", lambda: release.wait(10)):
        handle = start_save(
            tmp_path / "ckpt", Alone(), value_save(values, 3, staged=True), what="x"
        )
        values[:] = _floats(9, 9, 9, 9)  # the next training step, while the save is in flight
        assert not handle.done() and handle.ended is None
        release.set()
        manifest = handle.wait(timeout=10)
    assert manifest.step == 3 and handle.done()
    assert handle.ended is not None and handle.started < handle.ended <= time.monotonic()
    assert _stored(tmp_path / "ckpt") == [1, 2, 3, 4]
    assert os.path.islink(tmp_path / "ckpt")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice: Linux")
def test_the_writer_yields_the_cpu_to_training(tmp_path: Path) -> None:
    """The writer thread runs at niceness ``WRITER_NICE``; the training thread keeps its own."""
    seen = []
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def record() -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    with save_hook("before_file", record):
        save = value_save(_floats(1, 2, 3, 4), 1, staged=True)
        start_save(tmp_path / "ckpt", Alone(), save, what="x").wait(timeout=10)
    assert seen == [max(own, WRITER_NICE)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own


def test_a_second_save_waits_for_the_one_in_flight(tmp_path: Path) -> None:
    release, order = threading.Event(), []

    def slow_first_file() -> None:
        if not order:
            order.append("first save writing")
            release.wait(10)

    with save_hook("before_file", slow_first_file):
        first = start_save(
            tmp_path / "a", Alone(), value_save(_floats(1, 1, 1, 1), 1, staged=True), what="x"
        )
        done = []
        second = threading.Thread(
            target=lambda: done.append(
                run_save(
                    tmp_path / "b",
                    Alone(),
                    value_save(_floats(2, 2, 2, 2), 2, staged=False),
                    what="x",
                )
            )
        )
        second.start()
        time.sleep(0.3)
        assert not done and not first.done()  # the blocking save waits for the one in flight
        release.set()
        second.join(10)
    assert first.done() and done[0].step == 2
    assert _stored(tmp_path / "a") == [1, 1, 1, 1] and _stored(tmp_path / "b") == [2, 2, 2, 2]


def _disk_full() -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_failure_is_raised_at_wait_and_the_previous_checkpoint_stays(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    run_save(path, Alone(), value_save(_floats(1, 2, 3, 4), 1, staged=False), what="x")
    with save_hook("before_file", _disk_full):
        handle = start_save(
            path, Alone(), value_save(_floats(5, 6, 7, 8), 2, staged=True), what="cannot save P"
        )
        with pytest.raises(
            CheckpointError,
            match=r"cannot save P: rank 0 could not write its file: OSError: \[Errno 28\]",
        ):
            handle.wait(timeout=10)
    with pytest.raises(CheckpointError):  # wait() raises it again, as a future does
        handle.wait()
    assert _stored(path) == [1, 2, 3, 4] and read_manifest(path).step == 1
    assert wait_for_saves() is None  # raised by wait(): the next save starts
    run_save(path, Alone(), value_save(_floats(5, 6, 7, 8), 2, staged=False), what="x")
    assert _stored(path) == [5, 6, 7, 8]


def test_an_unwaited_failure_is_raised_by_the_next_save_once(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with save_hook("after_file", lambda: (_ for _ in ()).throw(RuntimeError("the writer broke"))):
        start_save(
            path, Alone(), value_save(_floats(1, 2, 3, 4), 1, staged=True), what="cannot save P"
        )
        time.sleep(0.2)
    with pytest.raises(
        CheckpointError,
        match="cannot save P: rank 0 could not write its file: RuntimeError: the writer broke",
    ):
        start_save(path, Alone(), value_save(_floats(5, 6, 7, 8), 2, staged=True), what="x")
    assert not path.exists()  # the failed save switched nothing in, the refused one started not
    handle = start_save(path, Alone(), value_save(_floats(5, 6, 7, 8), 2, staged=True), what="x")
    assert handle.wait(timeout=10).step == 2  # raised once: this save ran


def test_a_failure_to_stage_is_agreed_in_the_background(tmp_path: Path) -> None:
    steps = value_save(_floats(1, 2, 3, 4), 1, staged=True)

    def broken() -> Any:
        raise ValueError("state 'exp_avg' of 'w' is not a tensor")

    handle = start_save(
        tmp_path / "ckpt",
        Alone(),
        SaveSteps(prepare=broken, write_files=steps.write_files, manifest=steps.manifest),
        what="cannot save P",
    )
    with pytest.raises(
        CheckpointError, match="cannot save P: state 'exp_avg' of 'w' is not a tensor"
    ) as raised:
        handle.wait(timeout=10)
    assert isinstance(raised.value.__cause__, ValueError)
    assert not (tmp_path / "ckpt").exists()


_EXIT_WITH_SAVE_IN_FLIGHT = """
import array, errno, os, sys, time
sys.path.insert(0, {root!r})
from gradsync_core.checkpoint import save_hook, start_save
from tests.core.background_save_problem import Alone, value_save

def slow_then(fail):
    time.sleep(0.5)  # the interpreter is exiting by now
    if fail:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

hook = save_hook("before_file", lambda: slow_then(sys.argv[2] == "fail"))
hook.__enter__()
values = bytearray(array.array("f", [1, 2, 3, 4]).tobytes())
save = value_save(values, 7, staged=True)
start_save(sys.argv[1], Alone(), save, what="cannot save " + sys.argv[1])
print("returned", flush=True)
"""


@pytest.mark.parametrize("fail", [False, True], ids=["written", "failed"])
def test_exiting_with_a_save_in_flight_finishes_it_or_fails_loudly(
    tmp_path: Path, fail: bool
) -> None:
    path = tmp_path / "ckpt"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _EXIT_WITH_SAVE_IN_FLIGHT.format(root=str(ROOT)),
            str(path),
            "fail" if fail else "ok",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.stdout == "returned\n"
    if not fail:
        assert done.returncode == 0, done.stderr
        assert _stored(path) == [1, 2, 3, 4] and read_manifest(path).step == 7
        return
    # Before: an atexit function's exception is printed and the status stays 0.
    assert done.returncode == SAVE_FAILED_EXIT, done.stderr
    assert (
        f"gradsync: a background save failed and the program ended without waiting for it: "
        f"cannot save {path}: rank 0 could not write its file: OSError: [Errno 28] No space "
        "left on device"
    ) in done.stderr
    assert not path.exists()


def test_rank_files_from_buffers_are_safetensors_files(tmp_path: Path) -> None:
    values = array.array("f", [1.5, -2.0, 0.25])
    tensors = [
        TensorBytes("a", "F32", (3,), values),
        TensorBytes("b", "U8", (2, 0), b""),
        TensorBytes("c", "I64", (1,), struct.pack("<q", -7)),
    ]
    os.mkdir(tmp_path / "s")
    chunks = tensor_file(tensors, {"rank": "0", "world": "1"})
    digest = write_rank_file(str(tmp_path / "s"), "f.safetensors", chunks)
    data = (tmp_path / "s" / "f.safetensors").read_bytes()
    import hashlib

    assert digest == hashlib.sha256(data).hexdigest()
    (length,) = struct.unpack("<Q", data[:8])
    assert (8 + length) % 8 == 0
    header = json.loads(data[8 : 8 + length])
    assert header["__metadata__"] == {"rank": "0", "world": "1"}
    assert header["a"] == {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}
    assert header["b"]["data_offsets"] == [12, 12] and header["c"]["data_offsets"] == [12, 20]
    assert data[8 + length :] == values.tobytes() + struct.pack("<q", -7)


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (TensorBytes("a", "F33", (1,), b"abcd"), "dtype 'F33', not a safetensors one"),
        (TensorBytes("a", "F32", (2,), b"abcd"), r"has 4 bytes, expected 8"),
        (TensorBytes("__metadata__", "U8", (1,), b"a"), "repeated or reserved"),
    ],
    ids=["dtype", "size", "reserved key"],
)
def test_rank_files_refuse_tensors_that_do_not_add_up(tensor: TensorBytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tensor_file([tensor], {"rank": "0"})
