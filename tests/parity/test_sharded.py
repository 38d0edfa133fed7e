"""The patched layers under mlx-lm's own sharding (`model.shard(group)`), on the single-rank
group MLX gives without a distributed backend: the sharded code path (in-place sharded expert
weights, the MoE block's all_sum) runs through the ops and keeps stock's greedy tokens. The
multi-GPU run belongs to the GPU machine."""

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest

import mlx_moe_fix
from mlx_moe_fix import zoo


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_sharded_model_keeps_tokens_through_the_ops(family):
    group = mx.distributed.init()
    if group.size() != 1:
        pytest.skip("this test is for the single-rank group; multi-rank runs are on the GPU machine")
    prompt = zoo.prompt_for(family)
    unsharded = zoo.greedy_tokens(zoo.build(family, 4), prompt)
    model = zoo.build(family, 4)
    model.shard(group)
    assert any(getattr(layer.mlp, "sharding_group", None) is group for layer in model.layers)
    stock = zoo.greedy_tokens(model, prompt)
    with mlx_moe_fix.patched():
        patched = zoo.greedy_tokens(model, prompt)
    assert stock == unsharded and patched == stock
    paths = {(r.phase, r.path) for r in mlx_moe_fix.path_counts() if r.layer == "SwitchGLU"}
    assert paths == {("prefill", "reference"), ("decode", "reference")}, mlx_moe_fix.path_counts()


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_two_ranks_on_the_cpu_keep_the_unsharded_tokens(family):
    """Two processes over MLX's ring backend (localhost): the model really split across ranks,
    its MoE blocks all-summing between them. The zoo families whose expert widths (256 = four
    groups of 64) split in two; mlx-lm's mixtral has no shard()."""
    launcher = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    if not os.path.exists(launcher):
        pytest.skip(f"no mlx.launch beside {sys.executable}")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    port = str(20000 + (os.getpid() * 7 + len(family)) % 20000)
    done = subprocess.run(
        [launcher, "-n", "2", "--backend", "ring", "--starting-port", port, sys.executable, "-m",
         "benchmarks.sharded_tokens", "--family", family, "--backend", "ring"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    assert result["ranks"] == 2
    whole, sharded = result["expert_widths"]
    assert sharded * 2 == whole, result["expert_widths"]
    assert len(set(result["unsharded"])) >= 4, result
    assert result["stock"] == result["unsharded"] and result["patched"] == result["stock"], result
    # The fields that carry the comparison where tokens cannot (bf16 on GPUs): exact here.
    assert result["stock_reproducible"] and result["replay"]["compared"] == result["replay"]["calls"] > 0, result
    assert result["replay"]["max_relative_error"] == 0.0, result
    for run in ("stock", "patched"):
        forced = result["forced"][run]
        assert forced["clear_steps"] >= 24 and forced["clear_steps_alike"] == forced["clear_steps"], result
    assert ["SwitchGLU", "decode", "reference"] in result["paths"] and ["SwitchGLU", "prefill", "reference"] in result["paths"]
