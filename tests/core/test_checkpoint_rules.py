"""Checkpoint rules the executors share, written once in gradsync_core.checkpoint: canonical
optimizer names (and the spelling old manifests used), the weight-name check, the bounded
safetensors header."""

import json
import struct

import pytest

from gradsync_core.checkpoint import (
    LEGACY_OPTIMIZER_NAMES,
    canonical_optimizer,
    check_optimizer,
    check_weight_names,
    counterpart_keys,
    read_header,
)

ADAM = ("exp_avg", "exp_avg_sq", "step")


@pytest.mark.parametrize(
    ("torch_name", "other", "keys"),
    [
        ("torch.optim.Adam", "adam", ADAM),
        ("torch.optim.AdamW", "adamw", ADAM),
        ("torch.optim.SGD", "sgd_momentum", ("momentum_buffer",)),
        ("torch.optim.SGD", "sgd", ()),
        # version-2 manifests written before canonical names still pair up
        (
            "torch.optim.Adam",
            "optax:ScaleByAdamState,EmptyState",
            ADAM,
        ),
        (
            "torch.optim.AdamW",
            "optax:ScaleByAdamState,EmptyState,EmptyState",
            ADAM,
        ),
        ("torch.optim.Adam", "adamw", None),  # not a pair
        ("torch.optim.Adagrad", "adam", None),  # no counterpart at all
    ],
    ids=["adam", "adamw", "sgd-momentum", "sgd", "old-adam", "old-adamw", "adam-adamw", "adagrad"],
)
def test_counterparts_by_canonical_name(torch_name, other, keys):
    assert counterpart_keys(torch_name, other) == keys


def test_old_manifest_spellings_name_the_canonical_optimizers():
    assert {canonical_optimizer(old) for old in LEGACY_OPTIMIZER_NAMES} == {
        "adam",
        "adamw",
        "sgd",
        "sgd_momentum",
    }
    assert canonical_optimizer("optax:ScaleByLionState,EmptyState") is None
    # A JAX checkpoint saved under the old name loads into the same optimizer named anew ...
    check_optimizer("jax", "optax:ScaleByAdamState,EmptyState", "jax", "adam")
    # ... and never into another one.
    with pytest.raises(ValueError, match="written by optimizer 'optax:ScaleByAdamState"):
        check_optimizer("jax", "optax:ScaleByAdamState,EmptyState", "jax", "adamw")
    with pytest.raises(ValueError, match="has no counterpart"):
        check_optimizer("jax", "adam", "torch", "torch.optim.SGD")


def test_weight_names_name_both_sides():
    check_weight_names({"a", "b"}, ["b", "a"], fix="load the saved model")
    with pytest.raises(
        ValueError,
        match=r"it lacks 'fc\.weight' \(1 missing, 1 unexpected\); the checkpoint's unmatched "
        r"names start with 'Dense_0\.kernel'; load the saved model",
    ):
        check_weight_names({"Dense_0.kernel", "b"}, ["fc.weight", "b"], fix="load the saved model")
    with pytest.raises(ValueError, match=r"has 'extra', unknown here \(0 missing, 1 unexpected\);"):
        check_weight_names({"extra", "b"}, ["b"], fix="load the saved model")


def _safetensors(tmp_path, header: bytes, length: int | None = None, body: bytes = b""):
    path = tmp_path / "f.safetensors"
    size = len(header) if length is None else length
    path.write_bytes(struct.pack("<Q", size) + header + body)
    return path


def test_the_header_is_read_within_the_file(tmp_path):
    entries = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    header = json.dumps({**entries, "__metadata__": {"rank": "0"}}).encode()
    path = _safetensors(tmp_path, header, body=bytes(8))
    assert read_header(path) == (entries, 8 + len(header))
    # A forged length larger than the file is refused before anything is allocated or read.
    with pytest.raises(ValueError, match=r"has a header of 1099511627776 bytes in a file of"):
        read_header(_safetensors(tmp_path, header, length=1 << 40))
    with pytest.raises(ValueError, match="is truncated"):
        (tmp_path / "short").write_bytes(b"\x01\x02")
        read_header(tmp_path / "short")
    with pytest.raises(ValueError, match="not a JSON object"):
        read_header(_safetensors(tmp_path, b"[1, 2]"))
