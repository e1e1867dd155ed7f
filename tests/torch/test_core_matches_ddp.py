"""gradsync_core's bucket plan equals PyTorch DDP's assignment on real modules (docs/design.md §3).

Compared two ways: with torch's own assignment function, and with the buckets a real
``DistributedDataParallel`` reducer holds (``find_unused_parameters=True``, the mode in which
torch 2.13 applies the ``[first_cap, cap]`` limits at construction; with the default ``False``
it starts from one bucket and rebuilds after the first step with the same limits).
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradsync_core import DEFAULT_CAP_BYTES, DEFAULT_FIRST_CAP_BYTES, plan_buckets
from gradsync_torch._specs import named_parameters, param_specs


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 64)
        self.body = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
        self.head = nn.Linear(64, 1000, bias=False)
        self.head.weight = self.emb.weight  # tied: listed once, under its first name
        self.body[2].requires_grad_(False)


def mixed_dtypes():
    m = nn.Sequential(*[nn.Linear(200, 200) for _ in range(8)])
    m[1].to(torch.float64)
    m[5].to(torch.bfloat16)
    return m


MODELS = {
    "mlp-12x300": lambda: nn.Sequential(*[nn.Linear(300, 300) for _ in range(12)]),
    "tied-frozen": Tied,
    "mixed-dtypes": mixed_dtypes,
    "conv": lambda: nn.Sequential(
        nn.Conv2d(3, 64, 7), nn.BatchNorm2d(64), nn.Conv2d(64, 256, 3), nn.Linear(256, 10)
    ),
}
CAPS = [(DEFAULT_CAP_BYTES, DEFAULT_FIRST_CAP_BYTES), (300_000, 300_000), (100_000, 20_000)]


@pytest.fixture(scope="module")
def process_group():
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        yield
        dist.destroy_process_group()


def plan_names(module, cap, first):
    plan = plan_buckets(param_specs(module), cap_bytes=cap, first_cap_bytes=first)
    return [[s.name for s in b.slots] for b in plan.buckets]


@pytest.mark.parametrize("cap_first", CAPS, ids=["ddp-default", "equal-caps", "small"])
@pytest.mark.parametrize("model", MODELS)
def test_plan_equals_torch_assignment_function(model, cap_first):
    torch.manual_seed(0)
    module = MODELS[model]()
    cap, first = cap_first
    trainable = [(n, p) for n, p in named_parameters(module) if p.requires_grad]
    indices, _ = dist._compute_bucket_assignment_by_size(
        [p for _, p in trainable], [first, cap], [False] * len(trainable)
    )
    torch_names = [[trainable[i][0] for i in bucket] for bucket in reversed(indices)]
    assert plan_names(module, cap, first) == torch_names


@pytest.mark.parametrize("model", ["mlp-12x300", "tied-frozen", "mixed-dtypes"])
def test_plan_equals_a_real_ddp_reducer(process_group, model):
    torch.manual_seed(0)
    module = MODELS[model]()
    ddp = nn.parallel.DistributedDataParallel(module, find_unused_parameters=True)
    name_of = {id(p): n for n, p in named_parameters(module)}
    ddp_names = [
        [name_of[id(p)] for p in bucket.parameters()]
        for bucket in ddp.reducer._get_zeros_like_grad_buckets()
    ]
    assert plan_names(module, DEFAULT_CAP_BYTES, DEFAULT_FIRST_CAP_BYTES) == ddp_names
