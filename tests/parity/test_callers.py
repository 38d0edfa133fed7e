"""Callers the patched layers must not break: `mx.compile`d forwards and mlx-lm's BatchGenerator
(batched prefill of left-padded prompts, then batched decode), on the CPU through the references
and on the GPU through whatever `status()` says the ops run.

The families are mlx-lm's (BatchGenerator is mlx-lm's)."""

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, generation_stream

import mlx_moe_fix
from mlx_moe_fix import zoo

from .tolerance import assert_matches, references_only

MLX_LM_FAMILIES = tuple(f for f in zoo.FAMILIES if f not in zoo.MLX_VLM_FAMILIES)


def setup(device, family):
    dtype = mx.bfloat16 if device == "gpu" else mx.float32
    return zoo.build(family, 4, dtype=dtype), dtype, references_only()


def assert_ops_took_both_phases(references_only):
    """Every call went through an op, prefill and decode calls both (a batched decode call with
    many pairs per expert may run the prefill kernel: kernels.plan)."""
    paths = {(r.phase, r.path) for r in mlx_moe_fix.path_counts()}
    assert {phase for phase, _ in paths} == {"prefill", "decode"}, paths
    assert {path for _, path in paths} <= ({"reference"} if references_only else {"reference", "kernel"}), paths


@pytest.mark.parametrize("family", MLX_LM_FAMILIES)
def test_compiled_forward_takes_the_ops_and_matches_the_uncompiled_one(device, family):
    model, dtype, references_only = setup(device, family)
    prompt = mx.array([zoo.prompt_for(family)])

    def forward(tokens):
        return zoo.logits_of(model(tokens))

    stock_compiled = mx.compile(forward)(prompt)
    with mlx_moe_fix.patched():
        mlx_moe_fix.reset_path_counts()
        # A prompt (the prefill op) and a single token (the decode op), each compiled anew.
        results = [(mx.compile(forward)(tokens), forward(tokens)) for tokens in (prompt, prompt[:, :1])]
        assert_ops_took_both_phases(references_only)
    for compiled, plain in results:
        assert_matches(compiled, plain, references_only, dtype)
    if references_only:
        assert mx.array_equal(results[0][0], stock_compiled).item()


def batch_prompts(family: str) -> list:
    """Prompts of unequal lengths: left padding in the batch."""
    base = zoo.prompt_for(family)
    return [base, base[:25], base[5:38], base[:12]]


def skip_unless_batch_generator_runs_here():
    if generation_stream.device != mx.default_device():
        pytest.skip(f"BatchGenerator runs on mlx-lm's generation stream, made on {generation_stream.device} "
                    f"at import, not on {mx.default_device()}")


def batch_generated_tokens(model, prompts: list, max_tokens: int) -> list:
    """Greedy tokens of every prompt, generated as one batch by mlx-lm's BatchGenerator."""
    generator = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=len(prompts),
                               prefill_batch_size=len(prompts))
    uids = generator.insert(prompts)
    tokens = {uid: [] for uid in uids}
    while responses := generator.next_generated():
        for response in responses:
            tokens[response.uid].append(response.token)
    generator.close()
    return [tokens[uid] for uid in uids]


@pytest.mark.parametrize("family", MLX_LM_FAMILIES)
def test_batch_generator_tokens_match_stock(device, family):
    skip_unless_batch_generator_runs_here()
    model, _, references_only = setup(device, family)
    prompts = batch_prompts(family)
    stock = batch_generated_tokens(model, prompts, 8)
    with mlx_moe_fix.patched():
        mlx_moe_fix.reset_path_counts()
        patched = batch_generated_tokens(model, prompts, 8)
        assert_ops_took_both_phases(references_only)
    assert all(len(t) == 8 for t in stock + patched)
    if references_only:
        assert patched == stock
    else:
        # Kernels sum in another order: a near-tie may flip a token and the rest of its stream;
        # rows mixed up between sequences would change nearly all of them.
        same = sum(a == b for s, p in zip(stock, patched) for a, b in zip(s, p))
        assert same >= 3 * 8 * len(prompts) // 4, (stock, patched)
