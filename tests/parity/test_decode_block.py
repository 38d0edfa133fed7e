"""mlx-vlm's decode-block path (1 < L <= DECODE_BLOCK_SIZE, a block of drafted tokens that is
verified against token-by-token decode): every token's output must equal what a call with that
token alone gives. The decode kernel promises that and takes the block whole; where the decode
op runs its reference, upstream keeps its block path (off Metal: one unsorted projection of every
pair, through the patched QuantizedSwitchLinear)."""

import mlx.core as mx
import mlx.nn as nn
import pytest

import mlx_moe_fix
import mlx_moe_fix.env
import mlx_moe_fix.kernels
from mlx_moe_fix.kernels import moe_decode_reference
from mlx_moe_fix.kernels.backend import Implementation

pytest.importorskip("mlx_vlm")

TOKENS, HIDDEN, FFN, EXPERTS, TOP_K = 4, 64, 128, 4, 2


def block_call(limited: bool = False):
    """limited: DeepSeek-V4's experts (LimitedSwiGLU, a limit that binds on these inputs)."""
    from mlx_vlm.models.switch_layers import DECODE_BLOCK_SIZE, SwitchGLU

    assert 1 < TOKENS <= DECODE_BLOCK_SIZE
    mx.random.seed(3)
    if limited:
        from mlx_vlm.models.deepseek_v4.language import LimitedSwiGLU

        layer = SwitchGLU(HIDDEN, FFN, EXPERTS, activation=LimitedSwiGLU(0.05))
    else:
        layer = SwitchGLU(HIDDEN, FFN, EXPERTS)
    nn.quantize(layer, group_size=64, bits=4)
    layer.eval()
    x = mx.random.normal((1, TOKENS, HIDDEN))
    indices = mx.argsort(mx.random.uniform(shape=(1, TOKENS, EXPERTS)), axis=-1)[..., :TOP_K].astype(mx.uint32)
    weights = mx.softmax(mx.random.normal((1, TOKENS, TOP_K)), axis=-1)
    shared = mx.random.normal((1, TOKENS, HIDDEN))
    return layer, (x, indices, weights, shared)


def token_by_token(layer, args):
    return mx.concatenate([layer(*(a[:, t:t + 1] for a in args)) for t in range(TOKENS)], axis=1)


def vlm_paths():
    return {(r.phase, r.path, r.reason) for r in mlx_moe_fix.path_counts() if r.layer == "SwitchGLU[vlm]"}


def test_ref_block_stays_on_upstreams_block_path_and_matches_stock(cpu_device):
    layer, args = block_call()
    stock = layer(*args)
    mlx_moe_fix.reset_path_counts()
    with mlx_moe_fix.patched():
        patched = layer(*args)
    assert mx.array_equal(patched, stock).item()
    paths = vlm_paths()
    assert len(paths) == 1 and "stays on upstream's block path" in next(iter(paths))[2], paths


def test_the_limit_binds_in_the_limited_block():
    layer, (x, indices, *_) = block_call(limited=True)
    gate = layer.gate_proj(mx.expand_dims(x, (-2, -3)), indices)
    assert (mx.abs(gate) > 0.05).any().item()


def test_kernel_takes_the_block_whole_and_each_token_as_if_alone(cpu_device, monkeypatch):
    """With a decode "kernel" (the reference, counted) the block is one call, and each token's
    output is the one its single-token call gives."""
    calls = []

    def counted(x, indices, experts, weights=None):
        calls.append(x.shape)
        return moe_decode_reference(x, indices, experts, weights)

    monkeypatch.setattr(mlx_moe_fix.kernels, "moe_decode_implementation",
                        lambda experts=None, dtype=None: Implementation(counted, "kernel", "test kernel"))
    layer, args = block_call()
    mlx_moe_fix.reset_path_counts()
    with mlx_moe_fix.patched():
        block = layer(*args)
        assert calls == [(1, TOKENS, HIDDEN)], calls
        alone = token_by_token(layer, args)
    assert len(calls) == 1 + TOKENS
    assert mx.array_equal(block, alone).item()
    assert {(phase, path) for phase, path, _ in vlm_paths()} == {("decode", "kernel")}


@pytest.mark.parametrize("limited", [False, True])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_cuda_kernel_takes_the_block_whole_and_each_token_as_if_alone(cuda_device, dtype, limited, monkeypatch):
    """The real decode kernel on the block: one kernel call, each token's output bit for bit the
    one its single-token call gives (every (token, expert) pair is computed alike); with
    DeepSeek-V4's clamp stage too."""
    monkeypatch.setenv("MLX_MOE_FIX_CUDA_DECODE", "1")
    layer, args = block_call(limited)
    layer.set_dtype(dtype)
    args = tuple(a.astype(dtype) if a.dtype in (mx.float32, mx.bfloat16) else a for a in args)
    mlx_moe_fix.reset_path_counts()
    try:
        with mlx_moe_fix.patched():
            block = layer(*args)
            assert {(phase, path) for phase, path, _ in vlm_paths()} == {("decode", "kernel")}, vlm_paths()
            alone = token_by_token(layer, args)
    finally:
        monkeypatch.undo()
        mlx_moe_fix.env.refresh()  # the switches as the environment has them again
    assert mx.array_equal(block, alone).item()
