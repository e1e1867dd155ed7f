"""Every example runs in a small configuration and its printed differences hold (issue 22).

Each example prints its configuration, a baseline (torch DDP, the serial model, the
unsharded optimizer, an uninterrupted run) and its largest difference from it; these tests
run them as a user does (a subprocess; torchrun for the torch ones), read those lines and
hold them to the thresholds the examples state. The torch runs must also end without
"terminate called" (the barrier-then-destroy teardown), and progress bars must stay off
stdout. CPU only, few steps, small sizes. Each run is a fresh process (imports and
compilation dominate), so all but the NNX resume and the torch DDP comparison are marked
slow; they still run in the default suite.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each example is a fresh interpreter training a model

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 600
TOLERANCE = 1e-5


def run(args: list[str], *, torchrun: int = 0) -> subprocess.CompletedProcess:
    """Run an example as a user would, from a clean JAX environment; fail with its output."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    if torchrun:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command = [*launcher, f"--nproc_per_node={torchrun}", str(EXAMPLES / args[0])]
    else:
        command = [sys.executable, str(EXAMPLES / args[0])]
    done = subprocess.run(
        [*command, *args[1:]], env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    output = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, output
    assert "terminate called" not in done.stderr, output
    assert "it/s" not in done.stdout and "step/s" not in done.stdout, "a progress bar on stdout"
    assert done.stdout.startswith("config: ") or "\nconfig: " in done.stdout, output
    return done


def number(pattern: str, stdout: str) -> float:
    """The float printed after ``pattern`` (a regular expression) on some line."""
    found = re.search(pattern + r"\s*([-+0-9.e]+)", stdout)
    assert found, f"no line matches {pattern!r} in:\n{stdout[-2000:]}"
    return float(found.group(1))


def summary(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "example",
    ["flax_nnx_train.py", "flax_linen_train.py"],
)
def test_flax_save_then_resume_continues_the_run(example, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    small = ["--steps", "16", "--batch", "64"]
    first = run([example, "--save", ckpt, *small])
    fresh = summary(first.stdout)
    assert (fresh["start"], fresh["stop"], fresh["steps"]) == (0, 8, 16)
    assert "baseline: the unsharded optimizer" in first.stdout
    assert max(fresh["loss_diff"], fresh["param_diff"]) < TOLERANCE
    assert "(12.5%; 1/8 = 12.5%)" in first.stdout  # partition="auto": the state is 1/8
    # nnx resumes on another mesh (4 devices), linen on the same one.
    devices = ["--devices", "4"] if example == "flax_nnx_train.py" else []
    second = run([example, "--resume", ckpt, *devices])
    resumed = summary(second.stdout)
    assert (resumed["start"], resumed["stop"], resumed["steps"]) == (8, 16, 16)
    assert "baseline: an uninterrupted run of the same settings" in second.stdout
    assert number(r"resumed at step 8 .*learning rate", second.stdout) > 0
    lr = [number(rf"step\s+{i}\s+loss [0-9.]+\s+lr", second.stdout) for i in (8, 15)]
    assert lr[0] > lr[1] > 0, "the schedule continues over the total steps"
    assert number("largest relative loss difference from the baseline:", second.stdout) < (
        TOLERANCE
    )
    assert resumed["loss_diff"] < TOLERANCE and resumed["param_diff"] < TOLERANCE
    assert resumed["first_loss"] != fresh["first_loss"], "the next batches, not the first"


def test_flax_dp_train_matches_plain_jax():
    done = run(["flax_dp_train.py", "--steps", "12", "--devices", "4", "--accumulate", "2"])
    assert number("largest relative parameter difference from the baseline:", done.stdout) < (
        TOLERANCE
    )


def test_jax_tp_train_matches_the_serial_model():
    done = run(["jax_tp_train.py", "--steps", "3"])
    assert summary(done.stdout)["max_param_drift"] < 1e-4


def test_torch_train_matches_torch_ddp(tmp_path):
    args = ["torch_train.py", "--steps", "6", "--width", "32", "--depth", "2"]
    done = run([*args, "--out", str(tmp_path), "--log-every", "3"], torchrun=2)
    assert "replicas identical: True" in done.stdout
    assert number("largest relative parameter difference from torch DDP:", done.stdout) < (
        TOLERANCE
    )
    assert (tmp_path / "model.safetensors").exists()


def test_torch_tp_train_matches_the_serial_model():
    done = run(["torch_tp_train.py", "--tp", "2", "--cp", "1", "--steps", "3"], torchrun=2)
    assert summary(done.stdout)["max_param_drift"] < 1e-4


def test_cross_framework_continues_the_torch_run():
    """The README's two statements: below 1e-6 with the example's Adam b2 = 0.99, and more
    (Optax's float32 bias correction ``1 - b2**t``) with torch's default 0.999, still within
    the examples' tolerance. 5 steps a side: 4.4e-7 and 2.7e-6 when measured."""
    close = run(["cross_framework.py", "--steps", "5", "--b2", "0.99"])
    default = run(["cross_framework.py", "--steps", "5", "--b2", "0.999"])
    line = "largest relative loss difference after the switch:"
    assert number(line, close.stdout) < 1e-6
    assert 1e-6 < number(line, default.stdout) < TOLERANCE


def test_llama_nd_matches_one_process():
    """dp_shard 2 x tp 2 x pp 2 on 8 processes, float64: within the sums' rounding."""
    args = ["llama_nd.py", "--dp-shard", "2", "--tp", "2", "--pp", "2", "--float64"]
    done = run(args, torchrun=8)
    assert summary(done.stdout)["max_param_diff"] < 1e-10, done.stdout[-2000:]
    # rank 0 printed gradsync plan's per-rank bytes for the same layout before training
    assert "predicted by `gradsync plan --model llama-nd --world-size 8" in done.stdout
    assert "fullest: pp rank 0, peak" in done.stdout


def test_llama_nd_resumes_under_another_layout(tmp_path):
    """Saved under dp_shard 2 x tp 2 x pp 2, resumed under tp 2 x cp 2 x dp 2 (the
    single-process model loading the same checkpoint): still within the sums' rounding."""
    ckpt = str(tmp_path / "ckpt")
    args = ["llama_nd.py", "--float64", "--steps", "2", "--dp-shard", "2", "--tp", "2"]
    run([*args, "--pp", "2", "--save", ckpt], torchrun=8)
    done = run([*args, "--cp", "2", "--resume", ckpt], torchrun=8)
    assert "at step 2; it was saved under: torch, dp 2 x tp 2 x pp 2 (8 ranks)" in done.stdout
    assert "step 3: loss" in done.stdout
    assert summary(done.stdout)["max_param_diff"] < 1e-10, done.stdout[-2000:]
