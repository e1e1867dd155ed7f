"""The pipeline executor's pieces that need no process group: cutting a model into stage
modules, the metadata messages, and the microbatch order of gradient sums (docs/pipeline.md).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from examples.pipeline_models import gpt_blocks, lm_loss, token_batch
from gradsync_core import PipelinePlan, Topology, plan_pipeline
from gradsync_torch.pipeline import StageModule, split_model
from gradsync_torch.pipeline.backward import MicrobatchOrder
from gradsync_torch.pipeline.p2p import META_LEN, TensorMeta, decode, encode


def _plan(pp: int = 2, schedule: str = "1F1B", v: int | None = None) -> PipelinePlan:
    return plan_pipeline(
        schedule=schedule, microbatches=4, topology=Topology(pp=pp), layers=8, stages_per_rank=v
    )


def test_split_follows_the_layout_and_keeps_the_model_names():
    model = gpt_blocks()
    plan = _plan(pp=4)  # 'Et*2|t*3|t*2|tL'
    names, state = [], {}
    for rank in range(4):
        split = split_model(model, plan, rank)
        assert list(split.stages) == [rank]
        stage = split.stages[rank]
        names.append(stage.block_names)
        state |= stage.state_dict()
    assert names == [("0", "1", "2"), ("3", "4", "5"), ("6", "7"), ("8", "9")]
    whole = model.state_dict()
    assert state.keys() == whole.keys()
    assert all(torch.equal(state[k], whole[k]) for k in whole)
    # A stage is a copy: training it leaves the model as it was.
    stage = split_model(model, plan, 0).stages[0]
    with torch.no_grad():
        stage.get_parameter("0.token.weight").add_(1)
    assert torch.equal(model.state_dict()["0.token.weight"], whole["0.token.weight"])


def test_a_stage_computes_what_its_blocks_compute():
    model = gpt_blocks()
    tokens, targets = token_batch(2, 8, 32, seed=0)
    out = tokens
    for rank in range(2):
        out = split_model(model, _plan(), rank).stages[rank](out)
    assert torch.equal(out, model(tokens))
    assert torch.isfinite(lm_loss(out, targets))


def test_v_placement_and_dotted_names():
    plan = _plan(pp=2, schedule="ZBVZeroBubble")  # stages 0 and 3 on rank 0
    split = split_model(gpt_blocks(), plan, 0)
    assert sorted(split.stages) == [0, 3]
    blocks = [(f"layers.{i}", nn.Linear(3, 3)) for i in range(4)]
    plan = plan_pipeline(schedule="GPipe", microbatches=2, topology=Topology(pp=2), layers=2)
    stage = split_model(blocks, plan, 1).stages[1]
    assert sorted(stage.state_dict()) == [
        "layers.2.bias", "layers.2.weight", "layers.3.bias", "layers.3.weight"
    ]  # fmt: skip


def test_tied_weights_are_found_and_copied_per_stage():
    model = gpt_blocks(tied=True)
    split = split_model(model, _plan(), 1)
    assert split.tied == (("0.token.weight", "9.out.weight"),)
    first = split_model(model, _plan(), 0).stages[0].get_parameter("0.token.weight")
    last = split.stages[1].get_parameter("9.out.weight")
    assert first is not last and torch.equal(first, last)
    # On one rank (ZBV puts stages 0 and 3 on rank 0) the two stages still own a copy each.
    v = split_model(model, _plan(schedule="ZBVZeroBubble"), 0)
    assert v.stages[0].get_parameter("0.token.weight") is not v.stages[3].get_parameter(
        "9.out.weight"
    )


def test_split_refusals():
    plan = _plan()
    with pytest.raises(ValueError, match="the model has 9 blocks but the plan's layout"):
        split_model(gpt_blocks(layers=7), plan, 0)
    with pytest.raises(TypeError, match="chain of blocks"):
        split_model(nn.Linear(2, 2), plan, 0)
    shared = nn.Linear(4, 4)
    blocks = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4)) for _ in range(10)))
    for i in (0, 5, 9):
        blocks[i][0] = shared
    with pytest.raises(ValueError, match="shared by 3 stages"):
        split_model(blocks, _plan(pp=4), 0)
    no_layout = PipelinePlan.from_csv(plan.to_csv("compute_only"), topology=Topology(pp=2))
    with pytest.raises(ValueError, match="no layout"):
        split_model(gpt_blocks(), no_layout, 0)
    with pytest.raises(ValueError, match="two blocks are named"):
        StageModule([("a", nn.Linear(2, 2)), ("a", nn.Linear(2, 2))])


def test_metadata_round_trip_and_limits():
    metas = (
        TensorMeta((2, 8, 16), torch.float32, True),
        TensorMeta((2, 8), torch.int64, False),
    )
    message = encode(3, metas)
    assert message.shape == (META_LEN,)
    assert decode(message) == (1, 3, metas)
    assert decode(encode(3, None))[2] is None  # a dead edge
    with pytest.raises(ValueError, match="more than the 64"):
        encode(0, tuple(TensorMeta((1,) * 8, torch.float32, True) for _ in range(6)))


def test_microbatch_order_gives_in_order_bits_for_any_backward_order():
    """Looped BFS runs a stage's backwards last microbatch first; the gradients are still
    added in microbatch order, bit for bit the in-order sum (and not the reversed one)."""
    torch.manual_seed(0)
    layer = nn.Linear(16, 16)
    xs = [torch.randn(3, 16) * 10**i for i in range(4)]  # magnitudes apart: order shows

    def backward(mb: int) -> None:
        layer(xs[mb]).square().mean().backward()

    for mb in range(4):
        backward(mb)
    in_order = layer.weight.grad.clone()
    layer.weight.grad = None
    for mb in reversed(range(4)):
        backward(mb)
    reversed_sum = layer.weight.grad.clone()
    assert not torch.equal(in_order, reversed_sum)  # the order is visible in these sums
    layer.weight.grad = None
    order = MicrobatchOrder(list(layer.parameters()))
    for mb in reversed(range(4)):
        with order.microbatch(mb):
            backward(mb)
    assert torch.equal(layer.weight.grad, in_order)
    assert order.holding == 0
