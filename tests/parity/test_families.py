"""Breadth: every further mlx-lm MoE family of mlx_moe_fix.zoo_breadth, built small from its own
classes, keeps stock's greedy tokens with the package applied (tests/parity/test_greedy_tokens.py's
check: identical where the references run, teacher-forced where kernels do), and its SwitchGLU
calls went through the ops in both phases, not upstream's code."""

import mlx_moe_fix
import pytest

from mlx_moe_fix import zoo

from .test_greedy_tokens import assert_greedy_tokens_match_stock, moe_layer_paths, run_dtype


@pytest.mark.parametrize("family", zoo.BREADTH_FAMILIES)
def test_breadth_family_keeps_stock_greedy_tokens(device, family):
    dtype = run_dtype(device)
    model = zoo.build(family, 4, dtype=dtype)
    num_experts, top_k = zoo.BREADTH_FAMILIES[family].experts
    layers = zoo.moe_layers(model)
    assert layers and all(layer.gate_proj.weight.shape[0] == num_experts for _, layer in layers)
    assert_greedy_tokens_match_stock(model, family, dtype)
    ops = mlx_moe_fix.status()["ops"]
    assert moe_layer_paths(family) == {("prefill", ops["moe_prefill"]["path"]), ("decode", ops["moe_decode"]["path"])}, (
        mlx_moe_fix.path_counts())
