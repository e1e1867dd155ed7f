"""``gradsync plan --zero 3`` for the Llama reference: bytes per rank with every axis divided.

The expected figures are worked out by hand below from the model's sizes (docs/nd-parallel.md):
a rank holds its pipeline stage's layers, each weight its tensor-parallel slice, its ``ep``
share of the experts, and ``fully_shard`` cuts that along dim 0 over ``dp_shard`` (``edp``).
"""

import json

import pytest

from gradsync_core import Topology
from gradsync_core.cli._main import main
from gradsync_core.plan._llama import LLAMA_MODELS, Activations, LlamaShape, llama_memory

ND = LLAMA_MODELS["llama-nd"]  # vocab 64, dim 32, 4 layers, 4 heads (head_dim 8), 2 kv, ffn 64
F32 = 4


def run(capsys, *args):
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_llama3_8b_has_its_published_parameter_count():
    assert sum(s.numel for s in LLAMA_MODELS["llama3-8b"].specs()) == 8_030_261_248


def test_rank_specs_cut_columns_rows_and_stages():
    topo = Topology.create(8, tp=2, pp=2)
    first = {s.name: s.shape for s in ND.rank_specs(topo, 0)}
    last = {s.name: s.shape for s in ND.rank_specs(topo, 1)}
    assert first["tok_embeddings.weight"] == (64, 32)  # replicated over tp
    assert first["layers.0.attention.wq.weight"] == (16, 32)  # column: out / tp
    assert first["layers.1.attention.wk.weight"] == (8, 32)
    assert first["layers.0.attention.wo.weight"] == (32, 16)  # row: in / tp
    assert first["layers.0.feed_forward.w2.weight"] == (32, 32)  # (32, 64) / tp on dim 1
    assert first["layers.0.attention_norm.weight"] == (32,)
    assert not any(n.startswith(("layers.2", "layers.3", "norm", "output")) for n in first)
    assert last["output.weight"] == (32, 32)  # vocab / tp
    assert "norm.weight" in last and "tok_embeddings.weight" not in last
    assert {n.split(".")[1] for n in last if n.startswith("layers.")} == {"2", "3"}


def test_dp_shard_2_tp_2_pp_2_by_hand():
    # A layer on one tp rank: two norms 2*32, wq 16*32, wk and wv 8*32, wo 32*16, w1 w2 w3
    # 3 * 32*32 = 4,672 elements; over dp 2 every weight halves its (even) rows: 2,336.
    layer = 2 * 32 + 16 * 32 + 2 * 8 * 32 + 32 * 16 + 3 * 32 * 32
    assert layer == 4672
    embedding, norm_output = 64 * 32, 32 + 32 * 32
    rows = llama_memory(ND, Topology.create(8, tp=2, pp=2), optimizer="adamw")
    assert [(r.pp_rank, list(r.layers)) for r in rows] == [(0, [0, 1]), (1, [2, 3])]
    assert [r.numel for r in rows] == [embedding + 2 * layer, 2 * layer + norm_output]
    for row, root in zip(rows, (embedding, norm_output), strict=True):
        held = (root + 2 * layer) // 2 * F32
        m = row.memory
        assert (m.parameter_bytes, m.gradient_bytes) == (held, held)
        assert m.optimizer_state_bytes == (root + 2 * layer) // 2 * 8  # AdamW: two fp32 moments
        # Under the pipeline the stage is gathered whole for the step (UNSHARD before its first
        # forward, RESHARD after its last backward) and its gradients accumulate unsharded
        # over the microbatches; the last backward adds the largest unit's reduce-scatter
        # input (a layer's: both roots are smaller).
        stage = (root + 2 * layer) * F32
        assert m.transient_bytes == stage + stage + layer * F32
    assert [r.memory.peak_bytes for r in rows] == [200960, 185088]


def test_moe_experts_split_over_ep_and_sharded_over_edp():
    moe = LLAMA_MODELS["llama-nd-moe"]  # ffn 32, 4 experts
    topo = Topology.create(8, ep=2, pp=2)  # dp 4, edp 8 / (ep 2 * pp 2) = 2
    assert (topo.dp, topo.edp) == (4, 2)
    rows = llama_memory(moe, topo)
    # A layer's dense part on a rank: norms 2*32, wq 32*32, wk wv 16*32, wo 32*32, router
    # 4*32 = 3,264 elements, over dp 4: 816. Its experts: 4 / ep 2 = 2 of (32, 32) x 3, over
    # edp 2: 1 expert each, 3 * 1,024.
    dense_layer, expert_layer = 3264, 3 * 2 * 32 * 32
    assert rows[0].numel == 64 * 32 + 2 * (dense_layer + expert_layer)
    held = (64 * 32 // 4 + 2 * 816 + 2 * 3 * 1024) * F32
    assert rows[0].memory.parameter_bytes == held
    assert rows[0].memory.optimizer_state_bytes == 2 * held  # Adam: 8 bytes per element


@pytest.mark.parametrize(
    ("shape", "world", "axes", "message"),
    [
        (LLAMA_MODELS["llama3-8b"], 128, {"tp": 16}, "n_kv_heads 8 is not divisible by tp=16"),
        (ND, 8, {"tp": 4}, "n_kv_heads 2 is not divisible by tp=4"),
        (ND, 8, {"ep": 2}, "ep=2 needs a model with experts"),
        (LLAMA_MODELS["llama-nd-moe"], 8, {"tp": 2}, "does not cut experts over tp"),
        (ND, 8, {"pp": 8}, "8 stages are more than the 6 effective layers"),
        (
            LlamaShape(
                vocab_size=8,
                dim=8,
                n_layers=2,
                n_heads=2,
                n_kv_heads=2,
                ffn_dim=8,
                tie_embeddings=True,
            ),
            2,
            {"pp": 2},
            "a tied embedding under pp > 1",
        ),
    ],
)
def test_layouts_the_model_cannot_take_are_refused(shape, world, axes, message):
    with pytest.raises(ValueError, match=message):
        llama_memory(shape, Topology.create(world, **axes))


def test_cli_prints_each_stage_and_the_fullest(capsys):
    code, out, _ = run(
        capsys, "--model", "llama-nd", "--dp-shard", "2", "--tp", "2", "--pp", "2", "--zero", "3"
    )
    assert code == 0
    assert "world size 8 = dp_replicate 1 x dp_shard 2 x cp 1 x tp 2 x pp 2" in out
    assert "      0     0-1    11,392" in out and "      1     2-3    10,400" in out
    assert "fullest: pp rank 0, peak 0.19 MiB" in out


def test_cli_json_has_the_bytes_of_each_stage(capsys):
    code, out, _ = run(
        capsys, "--model", "llama-nd", "--tp", "2", "--pp", "2", "--zero", "3", "--json"
    )
    assert code == 0
    rows = json.loads(out)["composed_memory"]
    want = llama_memory(ND, Topology.create(8, tp=2, pp=2), optimizer="adam")
    assert [r["peak_bytes"] for r in rows] == [w.memory.peak_bytes for w in want]
    assert [r["layers"] for r in rows] == [[0, 2], [2, 4]]


def test_cli_hsdp_divides_by_the_shard_group_only(capsys):
    code, out, _ = run(
        capsys, "--model", "llama-nd", "--dp-shard", "2", "--tp", "2", "--json", "--zero", "3"
    )
    assert code == 0
    (row,) = json.loads(out)["composed_memory"]
    assert row["numel"] == 64 * 32 + 4 * 4672 + 32 + 32 * 32  # one stage: everything, tp 2
    assert row["parameter_bytes"] == row["numel"] // 2 * F32  # dp 4 = 2 shards x 2 replicas


def test_other_models_say_their_shapes_are_taken_as_given(capsys):
    code, out, _ = run(capsys, "--zero", "3", "--world-size", "8", "--tp", "2")
    assert code == 0
    assert "the planner cannot know how this model splits over tp, pp and ep" in out


def test_units_do_not_apply_to_a_builtin_llama(capsys):
    code, _, err = run(capsys, "--model", "llama-nd", "--zero", "3", "--units", "layers.0")
    assert code == 2
    assert "--units does not apply to a built-in Llama" in err


def test_dp_replicate_is_the_examples_spelling_of_hsdp(capsys):
    code, out, _ = run(
        capsys, "--model", "llama-nd", "--dp-replicate", "2", "--tp", "2", "--zero", "3", "--json"
    )
    assert code == 0
    assert json.loads(out)["topology"]["dp_shard"] == 2  # dp 4 / 2 replicas
    both = run(
        capsys,
        "--model",
        "llama-nd",
        "--dp-replicate",
        "2",
        "--dp-shard",
        "2",
        "--tp",
        "2",
        "--zero",
        "3",
        "--json",
    )[1]
    assert both == out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--dp-replicate", "3", "--tp", "2"],
            "--dp-replicate 3 does not divide the data-parallel",
        ),
        (
            ["--dp-replicate", "2", "--dp-shard", "1", "--tp", "2"],
            "--dp-replicate 2 x --dp-shard 1 is not the data-parallel size 4",
        ),
        (["--dp-replicate", "2", "--zero", "1"], "--dp-replicate applies to --zero 3 only"),
        (["--dp-replicate", "0"], "--dp-replicate must be between 1 and"),
    ],
)
def test_dp_replicate_that_does_not_fit_is_refused(capsys, args, message):
    code, _, err = run(capsys, "--model", "llama-nd", *args)
    assert code == 2
    assert message in err


# -- activations (--batch/--seq): the tensors autograd saves, checked against torch's in
# tests/torch/test_llama_activations.py; here, how the rows compose them.

BENCH = LLAMA_MODELS["llama-nd-bench"]


def test_a_pipeline_rank_holds_its_peak_stash_of_microbatches():
    topo = Topology.create(8, dp_shard=2, tp=2, pp=2)
    acts = Activations(batch=8, seq_len=32, schedule="1F1B", microbatches=4)
    rows = llama_memory(BENCH, topo, activations=acts)
    assert [r.stash for r in rows] == [2, 1]  # 1F1B over pp 2: the first rank warms up twice
    for row, first in zip(rows, (True, False), strict=True):
        one = BENCH.activation_bytes(
            topo, rows=1, seq_len=32, layers=2, first=first, last=not first, pipelined=True
        )  # 8 rows over dp 2 x 4 microbatches: 1 row each
        assert row.activation_bytes == row.stash * one
        assert row.peak_bytes == row.memory.peak_bytes + row.activation_bytes


def test_without_a_pipeline_a_rank_holds_its_whole_batch():
    topo = Topology.create(8, dp_shard=2, tp=2)  # dp 4
    (row,) = llama_memory(BENCH, topo, activations=Activations(batch=8, seq_len=32))
    assert row.stash == 1
    assert row.activation_bytes == BENCH.activation_bytes(topo, rows=2, seq_len=32, layers=4)
    (plain,) = llama_memory(BENCH, topo)
    assert (plain.stash, plain.activation_bytes) == (0, 0)
    assert plain.memory == row.memory


def test_one_block_by_hand():
    """llama-nd, one row of 8 tokens, float32, tp 1: the docstring's formula term by term."""
    d, h, hd, f, s = 32, 4, 8, 64, 8
    norms = 2 * (2 * s * d * F32 + s * F32)
    linear_inputs = 2 * s * d * F32
    rotary = 4 * s * hd * F32
    attention = 3 * h * s * hd * F32 + h * s * s * F32 + s * s + h * hd * s * F32
    mlp = 4 * s * f * F32
    want = norms + linear_inputs + rotary + attention + mlp
    got = ND.activation_bytes(
        Topology.create(1), rows=1, seq_len=s, layers=1, first=False, last=False
    )
    assert got == want


def test_cli_adds_the_activations_to_each_stage(capsys):
    flags = "--model llama-nd-bench --dp-shard 2 --tp 2 --pp 2 --zero 3 --optimizer adamw"
    flags += " --batch 8 --seq 32 --schedule 1F1B --microbatches 4"
    code, out, _ = run(capsys, *flags.split())
    assert code == 0
    assert "activations MiB (stash)" in out and "2.07 (2)" in out
    assert "fullest: pp rank 0, peak 24.08 MiB" in out
    code, out, _ = run(capsys, *flags.split(), "--json")
    rows = json.loads(out)["composed_memory"]
    assert [r["stash"] for r in rows] == [2, 1]
    for r in rows:
        assert r["peak_bytes"] == r["model_state_peak_bytes"] + r["activation_bytes"]
    code, out, _ = run(capsys, *flags.split()[:12])  # no batch: model states only, as before
    assert "give --batch and --seq" in out and "activations MiB" not in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--model llama-nd --zero 3 --batch 8", "need both --batch ROWS and --seq TOKENS"),
        ("--model llama-nd --zero 3 --batch 6 --seq 8", "pick a multiple of 8"),
        ("--model llama-nd --pp 2 --zero 3 --batch 8 --seq 8", "name the schedule"),
        (
            "--model llama-nd --pp 2 --zero 3 --batch 8 --seq 8 --schedule Interleaved1F1B "
            "--microbatches 4",
            "one stage per rank",
        ),
        ("--model llama-nd --zero 3 --batch 8 --seq 8 --microbatches 2", "leave them out"),
        ("--model llama-nd --tp 2 --zero 3 --batch 8 --seq 7", "pick a multiple of 2"),
        ("--model llama-nd-moe --zero 3 --batch 8 --seq 8", "the dense Llama only"),
        ("--model gpt2-small --zero 3 --batch 8 --seq 8", "of a built-in Llama"),
        ("--model llama-nd --batch 8 --seq 8", "under --zero 3"),
    ],
)
def test_activation_flags_that_do_not_fit_are_refused(capsys, flags, message):
    code, _, err = run(capsys, *flags.split())
    assert code == 2 and message in err, err


# -- --executor jax: examples/llama_nnx.py's parallelize, what its program holds


def test_jax_shares_each_sequence_parallel_gather():
    """Under sequence parallelism torch's wq, wk, wv, w1, w3 each gather their own input;
    the JAX program gathers once per attention and per MLP: 3 fewer ``s dim e`` per row and
    block, and the same bytes without sequence parallelism."""
    topo = Topology.create(8, tp=2, dp_shard=4)
    kw = dict(rows=2, seq_len=32, layers=4)
    torch_sp = BENCH.activation_bytes(topo, **kw)
    jax_sp = BENCH.activation_bytes(topo, **kw, shared_gather=True)
    assert torch_sp - jax_sp == 4 * 2 * 3 * 32 * 256 * F32
    plain = dict(kw, sequence_parallel=False)
    assert BENCH.activation_bytes(topo, **plain) == BENCH.activation_bytes(
        topo, **plain, shared_gather=True
    )


def test_jax_keeps_the_whole_stage_gathered_for_the_backward():
    """Without a pipeline the JAX program's dp_shard gathers are residuals of the backward:
    the transient bytes are the rank's whole tp slice of the stage (the benchmark's model at
    dp_shard 4 x tp 2: 2,361,600 elements); held bytes as torch's; nothing sharded, torch's
    estimate."""
    topo = Topology.create(8, tp=2, dp_shard=4)
    acts = dict(batch=8, seq_len=32)
    (torch_row,) = llama_memory(BENCH, topo, activations=Activations(**acts))
    (jax_row,) = llama_memory(BENCH, topo, activations=Activations(**acts, executor="jax"))
    assert jax_row.memory.transient_bytes == jax_row.numel * F32 == 2_361_600 * F32
    held = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes")
    for field in held:
        assert getattr(jax_row.memory, field) == getattr(torch_row.memory, field)
    assert jax_row.activation_bytes == BENCH.activation_bytes(
        topo, rows=2, seq_len=32, layers=4, shared_gather=True
    )
    replicated = Topology.create(8, tp=2, dp_shard=1)  # dp 4, all replicas
    (torch_dp,) = llama_memory(BENCH, replicated, activations=Activations(**acts))
    (jax_dp,) = llama_memory(BENCH, replicated, activations=Activations(**acts, executor="jax"))
    assert jax_dp.memory == torch_dp.memory


def test_cli_executor_jax(capsys):
    flags = "--model llama-nd-bench --dp-shard 4 --tp 2 --zero 3 --optimizer adamw"
    flags += " --batch 8 --seq 32"
    code, out, _ = run(capsys, *flags.split(), "--executor", "jax", "--json")
    assert code == 0
    (row,) = json.loads(out)["composed_memory"]
    assert row["transient_bytes"] == 2_361_600 * F32
    assert row["peak_bytes"] == 22_634_372  # benchmarks/nd_parallel.py measured 21,844,264
    code, _, err = run(capsys, *flags.split(), "--executor", "flax")
    assert code == 2 and "invalid choice: 'flax'" in err


def test_an_unknown_executor_is_refused():
    with pytest.raises(ValueError, match="executor 'flax' is not one of torch, jax; pick one"):
        Activations(batch=8, seq_len=32, executor="flax")
