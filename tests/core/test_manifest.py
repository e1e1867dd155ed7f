"""Checkpoint manifests: every field checked before anything loads, and a checksum of its own."""

import copy
import hashlib
import json
import os
import struct

import pytest

from gradsync_core import DataCursor, Manifest, ParamSpec, plan_greedy_shards, read_manifest
from gradsync_core.checkpoint import MANIFEST, rank_file, write_manifest
from gradsync_core.checkpoint._format import manifest_checksum

SPECS = (
    ParamSpec(name="fc.weight", shape=(4, 3)),
    ParamSpec(name="fc.bias", shape=(4,)),
    ParamSpec(name="emb.weight", shape=(5, 2), requires_grad=False),
)
KEYS = ("exp_avg", "exp_avg_sq", "step")


def _manifest(directory) -> Manifest:
    """A two-rank torch-style manifest whose rank files exist in ``directory``."""
    files = {}
    for rank in range(2):
        # A safetensors file of no tensors, recording its rank as every gradsync rank file does.
        header = json.dumps({"__metadata__": {"rank": str(rank), "world": "2"}}).encode()
        data = struct.pack("<Q", len(header)) + header
        with open(os.path.join(directory, rank_file(rank, 2)), "wb") as f:
            f.write(data)
        files[rank_file(rank, 2)] = hashlib.sha256(data).hexdigest()
    return Manifest(
        framework="torch",
        optimizer="torch.optim.Adam",
        world_size=2,
        step=7,
        params=SPECS,
        plan=plan_greedy_shards(SPECS, world_size=2),
        state_keys={"fc.weight": KEYS, "fc.bias": KEYS},
        files=files,
        extra={
            "param_groups": [
                {"lr": 0.001, "betas": [0.9, 0.999], "foreach": None, "amsgrad": False}
                | {"params": ["fc.weight", "fc.bias", "emb.weight"]}
            ],
            "scalars": {"fc.weight/step": 7.0, "fc.bias/step": 7.0},
            "shard_gradients": False,
        },
    )


def _write_json(directory, obj, *, checksum: bool) -> None:
    obj = {k: v for k, v in obj.items() if k != "checksum"}
    if checksum:
        obj["checksum"] = manifest_checksum(obj)
    with open(os.path.join(directory, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(obj, f)


def test_round_trip_with_checksum(tmp_path):
    manifest = _manifest(tmp_path)
    write_manifest(tmp_path, manifest)
    with open(tmp_path / MANIFEST, encoding="utf-8") as f:
        stored = json.load(f)
    assert stored["checksum"] == manifest_checksum(stored)
    assert len(stored["checksum"]) == 64 and stored["version"] == 2
    assert read_manifest(tmp_path) == manifest


def test_manifest_without_checksum_is_accepted(tmp_path):
    # Written before manifests carried a checksum: still read, still field-checked.
    manifest = _manifest(tmp_path)
    _write_json(tmp_path, manifest.to_json(), checksum=False)
    assert read_manifest(tmp_path) == manifest
    _write_json(tmp_path, manifest.to_json() | {"step": "seven"}, checksum=False)
    with pytest.raises(ValueError, match="manifest field 'step' is 'seven', expected an int"):
        read_manifest(tmp_path)


@pytest.mark.parametrize(
    ("old", "new"),
    [('"step": 7', '"step": 8'), ('"lr": 0.001', '"lr": 0.002'), ("Adam", "Adan")],
    ids=["step", "learning-rate", "optimizer"],
)
def test_one_changed_byte_is_refused(tmp_path, old, new):
    write_manifest(tmp_path, _manifest(tmp_path))
    path = tmp_path / MANIFEST
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1
    path.write_text(text.replace(old, new), encoding="utf-8")
    with pytest.raises(ValueError, match="does not match its own checksum"):
        read_manifest(tmp_path, verify_files=False)


def test_a_wrong_checksum_value_is_refused(tmp_path):
    obj = _manifest(tmp_path).to_json() | {"checksum": "0" * 64}
    with open(tmp_path / MANIFEST, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    with pytest.raises(ValueError, match="does not match its own checksum"):
        read_manifest(tmp_path)


def _parent(obj, path: str):
    """The container holding the last key of ``path`` (keys joined by '|', list indices ints)."""
    *parents, last = path.split("|")
    for key in parents:
        obj = obj[int(key)] if isinstance(obj, list) else obj[key]
    return obj, int(last) if isinstance(obj, list) else last


def _set(path: str, value):
    """A fault: set the field at ``path`` to ``value``."""

    def apply(obj):
        target, key = _parent(obj, path)
        target[key] = value

    return apply


def _drop(path: str):
    """A fault: delete the field at ``path``."""

    def apply(obj):
        target, key = _parent(obj, path)
        del target[key]

    return apply


def _cursor(**fields):
    """A data cursor's JSON (a dataset of 40 samples) with ``fields`` replaced."""
    return DataCursor(epoch=1, consumed=16, seed=3, dataset_size=40).to_json() | fields


FAULTS = [
    ("framework", _set("framework", "tensorflow"), "'framework' is 'tensorflow', expected one"),
    ("optimizer-number", _set("optimizer", 3), "'optimizer' is 3, expected a class name"),
    ("world-size-zero", _set("world_size", 0), "'world_size' is 0, expected an int >= 1"),
    ("world-size-string", _set("world_size", "2"), "'world_size' is '2', expected an int"),
    ("step-string", _set("step", "seven"), "'step' is 'seven', expected an int >= 0"),
    ("step-bool", _set("step", True), "'step' is True, expected an int >= 0"),
    ("step-negative", _set("step", -1), "'step' is -1, expected an int >= 0"),
    ("step-float", _set("step", 7.0), "'step' is 7.0, expected an int >= 0"),
    ("step-missing", _drop("step"), "manifest field 'step' is missing"),
    ("params-object", _set("params", {}), "'params' is {}, expected a list"),
    ("param-grad-string", _set("params|0|requires_grad", "no"), "'requires_grad' must be true"),
    ("param-shape", _set("params|1|shape", [4.0]), "'shape' must be a list of non-negative"),
    ("param-duplicate", _set("params|1|name", "fc.weight"), "appears twice"),
    ("plan-garbage", _set("plan", [1, 2]), "'plan' is [1, 2], expected a shard plan"),
    ("plan-world", _set("plan|world_size", 3), "'plan.world_size' is 3, expected world_size = 2"),
    ("plan-rank", _set("plan|shards|0|1", 5), "is 5, expected 0 <= rank < 2"),
    ("plan-stop", _set("plan|shards|0|3", 99), "expected 0 <= start <= stop <= "),
    ("plan-unknown-param", _set("plan|shards|0|0", "ghost"), "'plan.shards' is 'ghost'"),
    ("state-keys-dropped", _drop("state_keys|fc.bias"), "no entry for 'fc.bias'"),
    ("state-keys-string", _set("state_keys|fc.bias", "exp_avg"), "expected a list of distinct"),
    ("state-keys-repeated", _set("state_keys|fc.bias", ["mu", "mu"]), "a list of distinct"),
    ("state-keys-unknown", _set("state_keys|ghost", ["mu"]), "'state_keys' is 'ghost'"),
    ("file-missing", _drop("files|rank-00001-of-00002.safetensors"), "one file per rank of 2"),
    ("file-name", _set("files|model.bin", "0" * 64), "'files' is 'model.bin', expected a rank"),
    ("file-digest", _set("files|rank-00000-of-00002.safetensors", "abc"), "64 lowercase hex"),
    ("file-wrong-world", _set("files|rank-00002-of-00003.safetensors", "0" * 64), "per rank"),
    ("extra-list", _set("extra", []), "'extra' is [], expected a JSON object"),
    ("lr-string", _set("extra|param_groups|0|lr", "0.001"), "param_groups[0].lr' is '0.001'"),
    ("betas-strings", _set("extra|param_groups|0|betas", ["a"]), "expected a number, bool"),
    ("group-params", _set("extra|param_groups|0|params", "fc"), "params' is 'fc', expected a"),
    ("groups-object", _set("extra|param_groups", {}), "expected a list of param-group objects"),
    ("scalar-string", _set("extra|scalars|fc.bias/step", "7"), "is '7', expected a number"),
    ("lr-nan", _set("extra|param_groups|0|lr", float("nan")), "lr' is nan, expected a number"),
    ("eps-inf", _set("extra|param_groups|0|eps", float("inf")), "numbers finite"),
    ("scalar-nan", _set("extra|scalars|fc.bias/step", float("nan")), "numbers finite"),
    ("step-negative", _set("extra|scalars|fc.bias/step", -1), "expected a step count >= 0"),
    ("scalar-unlisted", _set("extra|scalars|fc.bias/exp_inf", 1.0), "of a key in 'state_keys'"),
    ("shard-gradients", _set("extra|shard_gradients", "yes"), "expected true or false"),
    ("partition", _set("extra|partition", 2), "'extra.partition' is 2"),
    ("global-keys", _set("extra|global_keys", "count"), "'extra.global_keys' is 'count'"),
    ("data-negative", _set("extra|data", _cursor(consumed=-1)), "consumed must be >= 0"),
    # Issue 33, item 6: past its dataset, a cursor loaded and then skipped the rest of the
    # epoch; at epoch 2**64 the first batch died in struct.pack.
    ("data-past-end", _set("extra|data", _cursor(consumed=40)), "consumed 40 is not below"),
    ("data-epoch", _set("extra|data", _cursor(epoch=2**64)), "in [0, 18446744073709551616)"),
]


@pytest.mark.parametrize(("fault", "message"), [f[1:] for f in FAULTS], ids=[f[0] for f in FAULTS])
@pytest.mark.parametrize("checksum", [True, False], ids=["checksummed", "old-manifest"])
def test_bad_fields_are_refused_before_loading(tmp_path, fault, message, checksum):
    obj = copy.deepcopy(_manifest(tmp_path).to_json())
    fault(obj)
    _write_json(tmp_path, obj, checksum=checksum)
    with pytest.raises(ValueError, match=r"manifest\.json: ") as caught:
        read_manifest(tmp_path)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 400


def test_faults_all_change_the_manifest(tmp_path):
    # A fault that silently did nothing would make its test pass for the wrong reason.
    valid = _manifest(tmp_path).to_json()
    for name, fault, _ in FAULTS:
        obj = copy.deepcopy(valid)
        fault(obj)
        assert json.dumps(obj) != json.dumps(valid), name  # json: 7.0 == 7 in Python


def test_a_stateless_optimizer_may_have_no_state_keys(tmp_path):
    # SGD without momentum keeps no state, so the torch writer lists no keys at all.
    manifest = _manifest(tmp_path)
    obj = manifest.to_json() | {"state_keys": {}}
    obj["extra"] = {"param_groups": manifest.extra["param_groups"]}
    _write_json(tmp_path, obj, checksum=True)
    assert read_manifest(tmp_path).state_keys == {}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{", "is corrupt"),
        (b"[" * 100_000 + b"]" * 100_000, "is corrupt"),
        (b'"just a string"', "not a gradsync optimizer checkpoint manifest"),
        (b'{"format": "gradsync-optimizer-checkpoint", "version": 3}', "format version 3"),
        (b"\xff\xfe", "is corrupt"),
    ],
    ids=["truncated", "deeply-nested", "not-an-object", "other-version", "not-utf8"],
)
def test_unreadable_manifests(tmp_path, content, message):
    (tmp_path / MANIFEST).write_bytes(content)
    with pytest.raises(ValueError, match=message) as caught:
        read_manifest(tmp_path)
    assert "\n" not in str(caught.value)


def test_rank_files_are_still_hashed(tmp_path):
    write_manifest(tmp_path, _manifest(tmp_path))
    (tmp_path / rank_file(1, 2)).write_bytes(b"rank 9")
    with pytest.raises(ValueError, match="does not match its manifest hash"):
        read_manifest(tmp_path)
    assert read_manifest(tmp_path, verify_files=False).step == 7
