"""Greedy-token parity: 32 tokens of each zoo model, identical with and without the patch, and
the patched run really went through the ops (not stock) in both phases."""

import mlx.core as mx
import pytest

import mlx_moe_fix
from mlx_moe_fix import zoo

N_TOKENS = 32
MOE_LAYER = {"deepseek_v4": "SwitchGLU[vlm]", "inkling": "InklingSwitchGLU"}


def first_difference(stock, stock_logits, patched, patched_logits) -> str:
    """Where the streams part and how close stock's own choice was there: both runs saw the same
    tokens up to that step, so a near-tie (a top-2 margin within the logits' error) tells a
    rounding-order flip from a wrong result."""
    step = next(i for i, (a, b) in enumerate(zip(stock, patched)) if a != b)
    top = mx.sort(stock_logits[step])[-2:].tolist()
    error = (mx.linalg.norm(patched_logits[step] - stock_logits[step]) / mx.linalg.norm(stock_logits[step])).item()
    return (f"first difference at token {step}: stock {stock[step]}, patched {patched[step]}; stock's top-2 logit "
            f"margin there {top[1] - top[0]:.3g} (largest logit {top[1]:.3g}); logits relative error there {error:.2e}")


@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_greedy_tokens_match_stock(device, family, bits):
    # On the GPU in bf16, as models run there (MLX's CUDA quantized_matmul lacks float32 kernels
    # for some small shapes, so stock itself fails in float32).
    model = zoo.build(family, bits, dtype=mx.bfloat16 if device == "gpu" else mx.float32)
    prompt = zoo.prompt_for(family)
    stock, stock_logits = zoo.greedy_decode(model, prompt, N_TOKENS)
    assert len(set(stock)) >= 4, f"degenerate stream, parity would prove little: {stock}"

    with mlx_moe_fix.patched():
        patched, patched_logits = zoo.greedy_decode(model, prompt, N_TOKENS)
    assert patched == stock, first_difference(stock, stock_logits, patched, patched_logits)

    layer = MOE_LAYER.get(family, "SwitchGLU")
    paths = {(r.phase, r.path) for r in mlx_moe_fix.path_counts() if r.layer == layer}
    ops = mlx_moe_fix.status()["ops"]
    expected = {("prefill", ops["moe_prefill"]["path"]), ("decode", ops["moe_decode"]["path"])}
    assert paths == expected, mlx_moe_fix.path_counts()
