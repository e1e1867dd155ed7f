"""gradsync checkpoint <-> torch Distributed Checkpoint (docs/interchange.md).

A model with a tied weight (``head.weight`` is ``embed.weight``) and a frozen layer: the
export restores bitwise through plain ``dcp.load`` and ``set_state_dict``, the import gives a
gradsync checkpoint that loads bitwise, and a checkpoint saved before the first step
exports as the state a first step creates (a plain ``dcp.load`` into a fresh AdamW's
``state_dict()`` would leave the moments out; the documented recipe does not).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from gradsync_core import read_manifest
from gradsync_torch import load_model_weights, load_optimizer_state_dict
from gradsync_torch.checkpoint.dcp import export_dcp, import_dcp
from gradsync_torch.checkpoint.plain_save import save_plain
from tests.torch.dcp_user import Tied, make, user_load_into


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    tokens = torch.arange(8) % 11
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(tokens), (tokens * 3) % 11).backward()
        opt.step()


def assert_same(a: tuple[nn.Module, torch.optim.Optimizer], b) -> None:
    for (name, x), (_, y) in zip(a[0].named_parameters(), b[0].named_parameters(), strict=True):
        assert torch.equal(x, y), name
    sa, sb = a[1].state_dict()["state"], b[1].state_dict()["state"]
    assert sa.keys() == sb.keys()
    for index, state in sa.items():
        assert state.keys() == sb[index].keys()
        for key, value in state.items():
            assert torch.equal(value, sb[index][key]), (index, key)


def user_load(path) -> tuple[Tied, torch.optim.AdamW]:
    return user_load_into(path, *make(seed=9))


def test_round_trip_is_bitwise(tmp_path) -> None:
    trained = make()
    train(*trained, steps=3)
    save_plain(tmp_path / "src", *trained)
    export_dcp(tmp_path / "src", tmp_path / "dcp", *make(seed=5))
    restored = user_load(tmp_path / "dcp")
    assert_same(trained, restored)
    assert "head.weight" in get_state_dict(*restored)[0]  # the tied name DCP users load

    import_dcp(tmp_path / "dcp", tmp_path / "back", *make(seed=7))
    assert read_manifest(tmp_path / "back").step == 3
    again = make(seed=8)
    load_model_weights(tmp_path / "back", again[0])
    load_optimizer_state_dict(tmp_path / "back", again[1], again[0])
    assert_same(trained, again)
    train(*trained, steps=1)  # and both continue alike
    train(*again, steps=1)
    assert_same(trained, again)


def test_no_state_yet_exports_the_first_steps_state(tmp_path) -> None:
    fresh = make()
    save_plain(tmp_path / "src", *fresh)  # saved before the first step: no state
    export_dcp(tmp_path / "src", tmp_path / "dcp", *make(seed=5))

    plain_model, plain_opt = make(seed=9)  # the pitfall: a fresh AdamW's own state_dict
    sd = {"model": plain_model.state_dict(), "optim": plain_opt.state_dict()}
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert sd["optim"]["state"] == {}  # the moments were silently left out

    restored = user_load(tmp_path / "dcp")
    state = restored[1].state_dict()["state"]
    assert all(s["step"].item() == 0 and not s["exp_avg"].any() for s in state.values())
    train(*fresh, steps=2)
    train(*restored, steps=2)
    assert_same(fresh, restored)


def test_import_of_another_model_is_one_sentence(tmp_path) -> None:
    trained = make()
    train(*trained, steps=1)
    save_plain(tmp_path / "src", *trained)
    export_dcp(tmp_path / "src", tmp_path / "dcp", *make())
    other = nn.Linear(6, 3)
    with pytest.raises(ValueError, match="cannot read DCP checkpoint"):
        import_dcp(tmp_path / "dcp", tmp_path / "x", other, torch.optim.AdamW(other.parameters()))


BUILD = """
from tests.torch.dcp_user import make


def build():
    model, optimizer = make(seed=3)
    return {"model": model, "optimizer": optimizer}
"""


def test_cli_export_and_import(tmp_path, capsys) -> None:
    from gradsync_core.cli._main import main

    trained = make()
    train(*trained, steps=2)
    save_plain(tmp_path / "src", *trained)
    (tmp_path / "build.py").write_text(BUILD)
    model = f"{tmp_path / 'build.py'}:build"
    src, out, back = (str(tmp_path / n) for n in ("src", "dcp", "back"))
    assert main(["checkpoint", "export", "--to", "dcp", src, out, "--model", model]) == 0
    assert_same(trained, user_load(out))
    assert main(["checkpoint", "import", "--from", "dcp", out, back, "--model", model]) == 0
    again = make(seed=8)
    load_model_weights(back, again[0])
    load_optimizer_state_dict(back, again[1], again[0])
    assert_same(trained, again)
    assert main(["checkpoint", "export", "--to", "dcp", src, out, "--model", "build"]) == 2
    assert "is not MODULE:FUNCTION" in capsys.readouterr().err
    assert main(["checkpoint", "export", "--to", "dcp", src, out, "--model", f"{model}x"]) == 2
    assert "has no function 'buildx'" in capsys.readouterr().err


def test_import_refuses_an_optimizer_that_would_load_no_state(tmp_path) -> None:
    trained = make()
    train(*trained, steps=1)
    save_plain(tmp_path / "src", *trained)
    export_dcp(tmp_path / "src", tmp_path / "dcp", *make())
    model, opt = make()
    train(model, torch.optim.SGD(model.parameters(), lr=0.0), steps=1)  # grads, no AdamW state
    with pytest.raises(ValueError, match=r"zero_grad\(set_to_none=True\) before importing"):
        import_dcp(tmp_path / "dcp", tmp_path / "x", model, opt)
    opt.zero_grad(set_to_none=True)
    import_dcp(tmp_path / "dcp", tmp_path / "x", model, opt)
    assert_same(trained, (model, opt))


class _Marker:
    """A pickle that, unpickled, creates the file ``path``: what a downloaded DCP checkpoint
    could run instead (issue 33, item 1)."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _forge_metadata(directory, edit) -> None:
    """Rewrite ``directory/.metadata`` (a DCP checkpoint's pickled ``Metadata``) as ``edit``
    returns it, read here with plain pickle from a file this test wrote."""
    import pickle

    path = directory / ".metadata"
    path.write_bytes(pickle.dumps(edit(pickle.loads(path.read_bytes()))))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A DCP checkpoint ``export_dcp`` wrote, to forge copies of."""
    tmp = tmp_path_factory.mktemp("dcp")
    trained = make()
    train(*trained, steps=1)
    save_plain(tmp / "src", *trained)
    export_dcp(tmp / "src", tmp / "dcp", *make())
    return tmp / "dcp"


def _copy(exported, tmp_path):
    import shutil

    return shutil.copytree(exported, tmp_path / "forged")


def test_import_never_runs_code_from_the_metadata(exported, tmp_path, capsys) -> None:
    from gradsync_core.cli._main import main

    forged, marker = _copy(exported, tmp_path), tmp_path / "ran"
    _forge_metadata(forged, lambda metadata: [metadata, _Marker(marker)])
    model, opt = make()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError) as refused:
        import_dcp(forged, tmp_path / "x", model, opt)
    assert not marker.exists(), "importing a DCP checkpoint ran code from its .metadata"
    assert re.search(
        r"\.metadata refers to \w+\.open, which is not DCP metadata", str(refused.value)
    )
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert not (tmp_path / "x").exists()

    (tmp_path / "build.py").write_text(BUILD)  # the command: exit 2, one line, nothing run
    build = f"{tmp_path / 'build.py'}:build"
    args = ["checkpoint", "import", "--from", "dcp", str(forged), str(tmp_path / "y")]
    assert main([*args, "--model", build]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not DCP metadata" in err, err
    assert not marker.exists()


def test_import_never_unpickles_a_tensor(exported, tmp_path) -> None:
    # Metadata of DCP's own classes only, which says a weight is pickled bytes
    # (BytesStorageMetadata, what DCP uses for param_groups): DCP would read those bytes with
    # torch.load(weights_only=False). The import reads tensors only, so it refuses first.
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    forged, marker = _copy(exported, tmp_path), tmp_path / "ran"
    import pickle

    payload = pickle.dumps(_Marker(marker))
    (forged / "evil.distcp").write_bytes(payload)

    def as_bytes(metadata):
        metadata.state_dict_metadata["model.embed.weight"] = BytesStorageMetadata()
        metadata.storage_data[MetadataIndex("model.embed.weight")] = _StorageInfo(
            relative_path="evil.distcp", offset=0, length=len(payload)
        )
        return metadata

    _forge_metadata(forged, as_bytes)
    model, opt = make()
    with pytest.raises(ValueError) as refused:
        import_dcp(forged, tmp_path / "x", model, opt)
    assert not marker.exists(), "importing a DCP checkpoint unpickled a stored object"
    assert re.search(r"'model\.embed\.weight' .* pickled", str(refused.value))
    import_dcp(exported, tmp_path / "x", model, opt)  # the real one imports
