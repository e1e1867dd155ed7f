"""``gradsync plan --model MODULE:FUNCTION`` (a live torch or Flax model) and a ``--params``
file's ``"tied"`` list (docs/cli.md): the plans and ZeRO-3 estimate are the ones the
executors' own specs give, tied weights included."""

import importlib.util
import json
import textwrap

import pytest

from gradsync_core import (
    BucketPlan,
    ParamShardPlan,
    block_prefixes,
    estimate_zero3,
    plan_buckets,
    plan_param_shards,
)
from gradsync_core.cli._main import main
from gradsync_core.plan._buckets import bucket_caps

TORCH_MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(8)
            self.fc = nn.Linear(8, 8)


    class TinyGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(11, 8)
            self.h = nn.ModuleList(Block() for _ in range(2))
            self.frozen = nn.Linear(8, 8)
            self.lm_head = nn.Linear(8, 11, bias=False)
            self.lm_head.weight = self.wte.weight  # tied
            self.frozen.requires_grad_(False)


    def build():
        torch.manual_seed(0)
        return TinyGPT()


    def nothing():
        return 42
    """
)

FLAX_MODEL = textwrap.dedent(
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from flax import nnx


    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = jnp.tanh(nn.Dense(11)(x))
            return nn.Dense(3)(x)


    def linen():
        return jax.eval_shape(MLP().init, jax.random.key(0), jnp.zeros((1, 7)))


    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(7, 11, rngs=rngs), nnx.Linear(11, 3, rngs=rngs)])


    def nnx_module():
        return Net(nnx.Rngs(0))
    """
)


def run(capsys, *args):
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def torch_model(tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "tiny_gpt.py"
    path.write_text(TORCH_MODEL)
    return path


def test_a_live_torch_model_plans_as_its_specs(capsys, torch_model, tmp_path, monkeypatch):
    from gradsync_torch import param_specs

    specs = param_specs(_module(torch_model).build())
    assert [s.name for s in specs if not s.requires_grad] == ["frozen.weight", "frozen.bias"]
    code, out, err = run(capsys, "--model", f"{torch_model}:build", "--world-size", "4", "--json")
    assert code == 0, err
    cap, first = bucket_caps(None)  # DDP's defaults, as the command uses
    want = plan_buckets(specs, cap_bytes=cap, first_cap_bytes=first)
    assert BucketPlan.from_json(json.loads(out)["buckets"]) == want
    # As a module on the path (the current directory), like checkpoint export's --model.
    monkeypatch.chdir(tmp_path)
    code, dotted, err = run(capsys, "--model", "tiny_gpt:build", "--world-size", "4", "--json")
    assert code == 0 and dotted == out, err
    # ZeRO-3: units by block, the tied embedding found by identity (lm_head.weight is wte's).
    code, out, err = run(
        capsys, "--model", "tiny_gpt:build", "--zero", "3", "--world-size", "4", "--json"
    )
    assert code == 0, err
    obj = json.loads(out)
    plan = plan_param_shards(specs, world_size=4, units=block_prefixes(specs))
    assert [u.prefix for u in plan.units] == ["", "h.0", "h.1"]
    assert ParamShardPlan.from_json(obj["param_shards"]) == plan
    assert obj["memory"] == estimate_zero3(plan, tied=["wte.weight"]).to_json()
    assert obj["memory"] != estimate_zero3(plan).to_json()  # the tie counts
    code, text, err = run(capsys, "--model", "tiny_gpt:build", "--zero", "3", "--world-size", "4")
    assert code == 0 and "Model tiny_gpt:build: " in text, err
    assert "tied weights (their gradient accumulated from two uses): wte.weight\n" in text


def _module(path):
    """The test's own model file, imported under a name of its own."""
    spec = importlib.util.spec_from_file_location(f"_twin_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_live_flax_model_plans_under_torchs_names(capsys, tmp_path, monkeypatch):
    pytest.importorskip("flax")
    from gradsync_jax import torch_specs

    (tmp_path / "flax_mlp.py").write_text(FLAX_MODEL)
    monkeypatch.chdir(tmp_path)
    code, out, err = run(
        capsys, "--model", "flax_mlp:linen", "--zero", "3", "--world-size", "4", "--json"
    )
    assert code == 0, err
    plan = ParamShardPlan.from_json(json.loads(out)["param_shards"])
    assert [(p.name, p.shape) for p in plan.params][:2] == [
        ("Dense_0.weight", (11, 7)),  # the kernel (7, 11) in torch's layout
        ("Dense_0.bias", (11,)),
    ]
    like = _module(tmp_path / "flax_mlp.py").linen()
    assert plan == plan_param_shards(torch_specs(like), world_size=4)
    # An NNX module: its Param state, named layers.0 / layers.1 (the units --units takes).
    args = ("--model", "flax_mlp:nnx_module", "--zero", "3", "--world-size", "4", "--json")
    code, out, err = run(capsys, *args, "--units", "layers.0,layers.1")
    assert code == 0, err
    units = ParamShardPlan.from_json(json.loads(out)["param_shards"]).units
    assert [u.prefix for u in units] == ["", "layers.0", "layers.1"]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("tiny_gpt:nothing", "--model 'tiny_gpt:nothing' returned int; return the model"),
        ("tiny_gpt:missing", "tiny_gpt has no function 'missing'"),
        ("no_such_module:build", "--model 'no_such_module:build': cannot import its module"),
        ("missing.py:build", "--model file 'missing.py' does not exist"),
    ],
    ids=["not-a-model", "no-function", "no-module", "no-file"],
)
def test_a_bad_live_model_is_one_line(capsys, torch_model, tmp_path, monkeypatch, model, message):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "--model", model)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1, err


ENTRIES = [
    {"name": "wte.weight", "shape": [11, 8]},
    {"name": "h.0.fc.weight", "shape": [8, 8]},
    {"name": "h.1.fc.weight", "shape": [8, 8]},
]


def test_a_parameter_files_tied_list_counts_in_the_zero3_estimate(capsys, tmp_path):
    path = tmp_path / "params.json"
    path.write_text(json.dumps({"params": ENTRIES, "tied": ["wte.weight"]}))
    code, out, err = run(
        capsys, "--params", str(path), "--zero", "3", "--world-size", "2", "--json"
    )
    assert code == 0, err
    obj = json.loads(out)
    plan = ParamShardPlan.from_json(obj["param_shards"])
    assert obj["memory"] == estimate_zero3(plan, tied=["wte.weight"]).to_json()
    assert obj["memory"] != estimate_zero3(plan).to_json()
    # --tied replaces the file's list.
    code, out, _ = run(
        capsys, "--params", str(path), "--zero", "3", "--world-size", "2", "--json", "--tied", ""
    )
    assert json.loads(out)["memory"] == estimate_zero3(plan).to_json()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"params": ENTRIES, "tied": ["lm_head.weight"]}, "tied parameter 'lm_head.weight' is not"),
        ({"params": ENTRIES, "tied": "wte.weight"}, "'tied' must be a list of parameter names"),
        ({"params": ENTRIES, "tide": ["wte.weight"]}, "has the key 'tide'; a parameter file"),
    ],
    ids=["unknown-name", "not-a-list", "unknown-key"],
)
def test_a_bad_tied_list_is_one_line(capsys, tmp_path, content, message):
    path = tmp_path / "params.json"
    path.write_text(json.dumps(content))
    code, out, err = run(capsys, "--params", str(path))
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1, err
