"""Callers the patched layers must not break: `mx.compile`d forwards and mlx-lm's BatchGenerator
(batched prefill of left-padded prompts, then batched decode), on the CPU through the references
and on the GPU through whatever `status()` says the ops run.

The families are mlx-lm's (BatchGenerator is mlx-lm's)."""

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, generation_stream

import mlx_moe_fix
from mlx_moe_fix import zoo

from .test_greedy_tokens import LOGITS_TOLERANCE, assert_clear_choices_match
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
    return batch_generated(model, prompts, max_tokens)[0]


class StreamLogits:
    """A logits processor for one BatchGenerator stream: keeps the raw logits of every step it
    sees and, given `forced` tokens, makes the stream pick forced[step] (teacher forcing inside a
    batch, so that two runs stay comparable past a first difference)."""

    def __init__(self, forced=None):
        self.steps, self.forced = [], forced

    def __call__(self, context, logits):
        step = len(self.steps)
        self.steps.append(logits[0].astype(mx.float32))
        if self.forced is None:
            return logits
        keep = mx.arange(logits.shape[-1]) == self.forced[step]
        return mx.where(keep, logits, mx.array(-mx.inf, logits.dtype))


def batch_generated(model, prompts: list, max_tokens: int, forced=None) -> tuple[list, list]:
    """Every prompt's generated tokens, and the raw logits [steps, vocab] of each stream's steps,
    from one batch of mlx-lm's BatchGenerator; with `forced` (per stream), teacher-forced."""
    processors = [StreamLogits(None if forced is None else forced[i]) for i in range(len(prompts))]
    generator = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=len(prompts),
                               prefill_batch_size=len(prompts))
    uids = generator.insert(prompts, logits_processors=[[p] for p in processors])
    tokens = {uid: [] for uid in uids}
    while responses := generator.next_generated():
        for response in responses:
            tokens[response.uid].append(response.token)
    generator.close()
    return [tokens[uid] for uid in uids], [mx.stack(p.steps) for p in processors]


@pytest.mark.parametrize("family", MLX_LM_FAMILIES)
def test_batch_generator_tokens_match_stock(device, family):
    skip_unless_batch_generator_runs_here()
    model, dtype, references_only = setup(device, family)
    prompts = batch_prompts(family)
    with zoo.recording_routes(model) as stock_routes:
        stock, stock_logits = batch_generated(model, prompts, 8)
    forced = [mx.argmax(steps, axis=-1).tolist() for steps in stock_logits]
    with mlx_moe_fix.patched():
        mlx_moe_fix.reset_path_counts()
        patched, _ = batch_generated(model, prompts, 8)
        with zoo.recording_routes(model) as routes:
            _, logits = batch_generated(model, prompts, 8, forced)
        assert_ops_took_both_phases(references_only)
    assert all(len(t) == 8 for t in stock + patched)
    if references_only:
        assert patched == stock
        assert all(mx.array_equal(a, b).item() for a, b in zip(logits, stock_logits))
        return
    # Kernels sum in another order, so the free-running streams may part at a near-tie: compared
    # as the greedy test does, under teacher forcing, all streams' steps together. Processor
    # call s of a stream comes from forward s + 1 of the batch (forward 0 prefills the prompts
    # but their last tokens); a stream's step is excused where that forward, or for step 0 the
    # prefill, routed one of the stream's tokens elsewhere than stock.
    steps = stock_logits[0].shape[0]
    forwards = zoo.rerouted_steps(routes, stock_routes, steps + 1, by_row=True)
    assert len(forwards[0]) == len(prompts) and len(routes) == (steps + 1) * len(zoo.moe_layers(model))
    rerouted = [forwards[s + 1][row] or (s == 0 and forwards[0][row]) for row in range(len(prompts)) for s in range(steps)]
    assert_clear_choices_match(sum(forced, []), mx.concatenate(stock_logits),
                               mx.argmax(mx.concatenate(logits), axis=-1).tolist(), mx.concatenate(logits),
                               rerouted, LOGITS_TOLERANCE[dtype])


def test_batch_generator_teacher_forcing_feeds_the_forced_tokens(device):
    skip_unless_batch_generator_runs_here()
    model, _, _ = setup(device, "qwen3_moe")
    prompts = batch_prompts("qwen3_moe")
    own, _ = batch_generated(model, prompts, 8)
    forced = [[(token + 1 + i) % zoo.VOCAB for token in stream] + [0] for i, stream in enumerate(own)]
    tokens, logits = batch_generated(model, prompts, 8, forced)
    assert tokens == [stream[:8] for stream in forced] and tokens != own
    # each stream's logits are its own, fed the forced tokens: not another stream's
    assert not mx.array_equal(logits[0][1:], logits[1][1:]).item()
