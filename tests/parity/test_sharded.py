"""The patched layers under mlx-lm's own sharding (`model.shard(group)`), on the single-rank
group MLX gives without a distributed backend: the sharded code path (in-place sharded expert
weights, the MoE block's all_sum) runs through the ops and keeps stock's greedy tokens. The
multi-GPU run belongs to the GPU machine."""

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
