"""Compiled calls (patches/compiled.py), decode steps and prefills at a repeated shape: the same
tokens, logits and path counts as the calls built in Python, new weights followed, no layer kept
alive, the keys a layer keeps bounded. On the CPU the compiled path is allowed for the test (it
runs the references there); on a GPU it is the real one."""

import gc
import os
import weakref

import mlx.core as mx
import pytest

import mlx_moe_fix
from mlx_moe_fix import env, trace, zoo
from mlx_moe_fix.patches import compiled

from ..conftest import switch_cuda_kernels_on

FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3", "deepseek_v4", "inkling")


@pytest.fixture
def compiled_steps(device, monkeypatch):
    """Our CUDA kernels switched on (on the GPU the compiled paths need them, whatever the
    environment says) and, on the CPU, the compiled path allowed there; yields a function that
    sets MLX_MOE_FIX_COMPILED_DECODE."""
    switch_cuda_kernels_on(monkeypatch)
    if device == "cpu":
        monkeypatch.setattr(compiled, "BACKENDS", ("cpu",))

    def use(on: bool):
        os.environ[compiled.SWITCH] = "1" if on else "0"
        env.refresh()

    yield use
    os.environ.pop(compiled.SWITCH, None)
    monkeypatch.undo()
    env.refresh()


STEPS = compiled._ATTRIBUTE


def steps_of(model) -> int:
    """Compiled steps (traced keys) on the model's layers."""
    return sum(isinstance(step, compiled._Step) for _, m in model.named_modules()
               for step in m.__dict__.get(STEPS, {}).values())


def decode(model, family: str, n: int = 6):
    """Greedy steps from a one-token prompt: every call is one token, the compiled path's size
    (the prefill too; a longer prompt's prefill is not compiled)."""
    mlx_moe_fix.reset_path_counts()
    tokens, logits = zoo.greedy_decode(model, zoo.prompt_for(family)[:1], n)
    return tokens, logits, mlx_moe_fix.path_counts()


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_decode_steps_match_python_built_steps(compiled_steps, family):
    model = zoo.build(family, 4, dtype=mx.bfloat16)
    with mlx_moe_fix.patched():
        compiled_steps(True)
        replayed = decode(model, family)  # compiled from the model's first call on
        compiled_steps(False)
        built = decode(model, family)
        assert steps_of(model) > 0, "no compiled step was made"
    assert replayed[0] == built[0]
    assert mx.array_equal(replayed[1], built[1]).item()
    assert replayed[2] == built[2], "path counts differ: a replayed step must count as the step it replays"


def test_compiled_step_follows_new_weights(compiled_steps):
    """The weights are the compiled graph's inputs: replacing them (same shapes) changes the
    output as it changes the Python-built one."""
    family = "qwen3_moe"
    model = zoo.build(family, 4, dtype=mx.bfloat16)
    other = zoo.build(family, 4, seed=1, dtype=mx.bfloat16)
    compiled_steps(True)
    with mlx_moe_fix.patched():
        decode(model, family)
        assert steps_of(model) > 0
        steps_before = steps_of(model)
        model.update(other.parameters())
        replayed = decode(model, family)
        assert steps_of(model) == steps_before, "new weights of the same shapes must not need new traces"
        compiled_steps(False)
        built = decode(model, family)
    assert replayed[0] == built[0]
    assert mx.array_equal(replayed[1], built[1]).item()


def test_layers_with_compiled_steps_are_freed(compiled_steps):
    family = "qwen3_moe"
    model = zoo.build(family, 4, dtype=mx.bfloat16)
    compiled_steps(True)
    with mlx_moe_fix.patched():
        decode(model, family, 2)
    layers = [weakref.ref(m) for _, m in model.named_modules() if STEPS in m.__dict__]
    assert layers
    del model
    gc.collect()
    assert all(layer() is None for layer in layers), "a compiled step keeps its layer alive"


def test_a_layers_last_step_is_freed_without_the_cycle_collector(compiled_steps):
    """The record of a layer's last step holds the layer's children and a copy of its attributes,
    itself among them only weakly: dropped, it is freed by reference counting (a cycle would keep
    the children, weights included, for Python's cycle collector)."""
    model, (block,), x = first_blocks(count=1)
    with mlx_moe_fix.patched():
        compiled_steps(True)
        for _ in range(3):
            block(x)
    record = weakref.ref(block.__dict__[compiled._LAST_STEP])
    assert compiled._last_step(block, (x,), {}) is record().step
    gc.disable()
    try:
        object.__delattr__(block, compiled._LAST_STEP)
        assert record() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_compiled_batched_decode_matches_python_built(compiled_steps, family):
    """mlx-lm's BatchGenerator: its decode steps (4 rows, left-padded prompts) compiled against
    built in Python; the same tokens (the kernels run alike in both)."""
    from .test_callers import batch_generated_tokens, batch_prompts, skip_unless_batch_generator_runs_here

    skip_unless_batch_generator_runs_here()
    model = zoo.build(family, 4, dtype=mx.bfloat16)
    prompts = batch_prompts(family)
    tokens = {}
    with mlx_moe_fix.patched():
        for on in (False, True):
            compiled_steps(on)
            tokens[on] = batch_generated_tokens(model, prompts, 8)
        assert steps_of(model) > 0
    assert tokens[True] == tokens[False]


def test_a_call_mlx_cannot_trace_stays_built_in_python(compiled_steps):
    """Upstream code that evaluates an array inside the call (MLX refuses that in a trace): the
    first call is built in Python, the failed trace of the second leaves the key built in Python,
    and the layer's arrays, its modules' included, are its own again after the failed trace (MLX
    leaves its tracers in their place)."""
    import mlx.nn as nn

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = mx.full((4,), 0.5)

    class Evaluating(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = mx.ones((4,))
            self.inner = Inner()

        def __call__(self, x):
            return x * self.w.sum().item() * self.inner.w.sum().item()

    def counted(wrapped, instance, args, kwargs):
        trace.record("Evaluating", "decode", "stock", "test", lambda: ())
        return wrapped(*args, **kwargs)

    compiled_steps(True)
    call = compiled.compiled_per_shape(counted)
    layer, x = Evaluating(), mx.ones((1, 4))
    outputs = [call(layer.__call__, layer, (x,), {}) for _ in range(3)]
    assert all(mx.array_equal(out, x * 8).item() for out in outputs)
    assert list(layer.__dict__[STEPS].values()) == [compiled._BUILT_IN_PYTHON]
    assert list(mlx_moe_fix.path_counts().values()) == [3], "the failed trace's call must count once"


def prefill_logits(model, family: str, length: int):
    """The logits of a `length`-token prompt prefilled in one call into a fresh cache, and the
    path counts of that call."""
    mlx_moe_fix.reset_path_counts()
    logits = zoo.logits_of(model(mx.array([zoo.prompt_for(family, length)]), cache=zoo.make_cache(model)))
    mx.eval(logits)
    return logits, mlx_moe_fix.path_counts()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v4", "inkling"])
def test_prefill_at_a_repeated_shape_replays_what_python_builds(compiled_steps, family, monkeypatch):
    """A prompt length that comes back (as a long prompt's 2048-token chunks do): its first call
    built in Python, its second traced, its third replayed, each with the logits and path counts
    of a call built in Python."""
    model = zoo.build(family, 4, dtype=mx.bfloat16)
    length = compiled.DECODE_TOKENS + 8
    monkeypatch.setenv(compiled.PREFILL_COMPILE_SWITCH, "1")
    with mlx_moe_fix.patched():
        compiled_steps(True)  # (refreshes the switches)
        calls = [prefill_logits(model, family, length) for _ in range(3)]
        assert steps_of(model) > 0, "no prefill call was compiled"
        monkeypatch.setenv(compiled.PREFILL_COMPILE_SWITCH, "0")
        env.refresh()
        steps_before = steps_of(model)
        built = prefill_logits(model, family, length)
        assert steps_of(model) == steps_before
    for logits, counts in calls:
        assert mx.array_equal(logits, built[0]).item()
        assert counts == built[1], "path counts differ: a replayed call must count as the call it replays"


def test_a_layer_keeps_at_most_max_keys_dropping_untraced_ones_first(compiled_steps, monkeypatch):
    """Prompt lengths seen once leave a key each (untraced where steps are not shared); past
    MAX_KEYS the oldest untraced key goes, and a traced one stays."""
    import mlx.nn as nn

    class Doubling(nn.Module):
        def __call__(self, x):
            return x * 2

    monkeypatch.setenv(compiled.PREFILL_COMPILE_SWITCH, "1")
    monkeypatch.setenv(compiled.SHARE_SWITCH, "0")
    compiled_steps(True)  # (refreshes the switches)
    monkeypatch.setattr(compiled, "MAX_KEYS", 3)
    call = compiled.compiled_per_shape(lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
    layer = Doubling()
    for rows in (1, 1, 1, 40, 50, 60, 70):  # (1, 4) traced at its second call; the others seen once
        x = mx.ones((rows, 4))
        assert mx.array_equal(call(layer.__call__, layer, (x,), {}), x * 2).item()
    steps = layer.__dict__[STEPS]
    assert [key[0][0][0] for key in steps] == [(1, 4), (60, 4), (70, 4)]
    assert isinstance(steps[next(iter(steps))], compiled._Step)


def test_a_new_prompt_length_is_traced_once_and_replayed_by_every_layer(compiled_steps, monkeypatch):
    """After a model's first call, a prompt length's first call is traced by the first layer and
    replayed by every other layer of its structure from its own first call (none builds it in
    Python), with the logits and path counts of the forward built in Python; then it replays. At
    the next new length the layers take their structures as kept, without reading them again."""
    family = "qwen3_moe"
    model = zoo.build(family, 4, dtype=mx.bfloat16)
    blocks = [m for _, m in model.named_modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock"]
    assert len(blocks) >= 2
    length = compiled.DECODE_TOKENS + 9
    monkeypatch.setenv(compiled.PREFILL_COMPILE_SWITCH, "1")
    with mlx_moe_fix.patched():
        compiled_steps(True)  # (refreshes the switches)
        prefill_logits(model, family, length - 1)  # the model's first call: built in Python
        assert steps_of(model) == 0
        calls = [prefill_logits(model, family, length)]
        taken = [step for block in blocks for key, step in block.__dict__[STEPS].items() if key[0][0][0][1] == length]
        assert len(taken) == len(blocks) and all(isinstance(step, compiled._Step) for step in taken)
        assert len(set(map(id, taken))) == 1 and len(taken[0].traces) == 1, "one trace, shared by every layer"
        calls.append(prefill_logits(model, family, length))
        assert len(taken[0].traces) == 1
        reads = []
        read = compiled._layer_structure
        monkeypatch.setattr(compiled, "_layer_structure", lambda layer: reads.append(layer) or read(layer))
        prefill_logits(model, family, length + 1)
        assert not reads, "a layer's structure is kept with its last step while the layer is unchanged"
        monkeypatch.setenv(compiled.PREFILL_COMPILE_SWITCH, "0")
        env.refresh()
        built = prefill_logits(model, family, length)
    for logits, counts in calls:
        assert mx.array_equal(logits, built[0]).item()
        assert counts == built[1]


def test_a_layer_takes_its_last_step_only_while_that_steps_key_holds(compiled_steps):
    """compiled._last_step (the step of a layer's last compiled call, found without building the
    key) gives way when a child or a scalar attribute of the layer changes: the call then follows
    the new child or scalar as a call built in Python does."""
    family = "qwen3_moe"
    model = zoo.build(family, 4, dtype=mx.bfloat16)
    other = zoo.build(family, 4, seed=1, dtype=mx.bfloat16)
    block, other_block = (next(m for _, m in built.named_modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock")
                          for built in (model, other))
    hidden = block.gate.scales.shape[-1] * block.gate.group_size
    x = mx.random.normal((1, 1, hidden), key=mx.random.key(3)).astype(mx.bfloat16)

    def replayed():
        """Three calls (built, traced, replayed where the key is new) and the last one's output;
        the layer's last step then stands for its key."""
        outputs = [block(x) for _ in range(3)]
        assert compiled._last_step(block, (x,), {}) is not None
        return outputs[-1]

    with mlx_moe_fix.patched():
        compiled_steps(True)
        first = replayed()
        block.gate = other_block.gate
        assert compiled._last_step(block, (x,), {}) is None, "a new child must not take the old step"
        new_gate = replayed()
        block.norm_topk_prob = not block.norm_topk_prob
        assert compiled._last_step(block, (x,), {}) is None, "a new scalar must not take the old step"
        new_scalar = replayed()
        assert compiled._last_step(block, (x.astype(mx.float32),), {}) is None
        compiled_steps(False)
        built_new_scalar = block(x)
        block.norm_topk_prob = not block.norm_topk_prob
        built_new_gate = block(x)
    assert mx.array_equal(new_scalar, built_new_scalar).item()
    assert mx.array_equal(new_gate, built_new_gate).item() and not mx.array_equal(new_gate, first).item()


def test_a_blocks_last_step_with_a_residual_holds_for_that_arity_shape_and_dtype_only(compiled_steps):
    """A routed block called with the decoder layer's residual (patches/decoder_layers.py) replays
    its last step for calls of x and a residual of x's shape and dtype, and for no other call:
    each replay adds the residual it is given, as a call built in Python does."""
    model = zoo.build("qwen3_moe", 4, dtype=mx.bfloat16)
    block = next(m for _, m in model.named_modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock")
    hidden = block.gate.scales.shape[-1] * block.gate.group_size
    x, residual, other = (mx.random.normal((1, 1, hidden), key=mx.random.key(seed)).astype(mx.bfloat16) for seed in (3, 4, 5))
    with mlx_moe_fix.patched():
        compiled_steps(True)
        for _ in range(3):
            alone = block(x)
        assert compiled._last_step(block, (x,), {}) is not None
        assert compiled._last_step(block, (x, residual), {}) is None, "another arity must not take the step"
        replayed = [block(x, r) for r in (residual, residual, residual, other)]
        assert compiled._last_step(block, (x, residual), {}) is not None
        assert compiled._last_step(block, (x,), {}) is None
        assert compiled._last_step(block, (x, residual.astype(mx.float32)), {}) is None
        assert compiled._last_step(block, (x, residual[..., :1]), {}) is None
        assert compiled._last_step(block, (x, None), {}) is None
        compiled_steps(False)
        built = [block(x, r) for r in (residual, other)]
    assert steps_of(model) > 0
    assert mx.array_equal(replayed[2], built[0]).item() and mx.array_equal(replayed[3], built[1]).item()
    assert mx.array_equal(built[0], residual + alone).item()


# deepseek_v4's small layers differ in structure (a hash-routed one) and each of its models has a
# config object of its own (counted by identity): none of its steps is shared here.
def test_a_blocks_last_step_with_token_ids_holds_for_their_shape_and_dtype_only(compiled_steps):
    """DeepSeek-V4's MoE blocks take the token ids after x (its hash-routed layers route by them):
    the block replays its last step for ids of the shape and dtype it was taken with, and each
    replay routes by the ids it is given, as a call built in Python does."""
    model = zoo.build("deepseek_v4", 4, dtype=mx.bfloat16)
    block = next(m for _, m in model.named_modules() if type(m).__name__ == "DeepseekV4MoE" and m.gate.hash)
    x = mx.random.normal((1, 1, block.gate.weight.shape[-1]), key=mx.random.key(3)).astype(mx.bfloat16)
    ids = [mx.array([[token]], dtype=mx.int32) for token in (5, 17)]
    with mlx_moe_fix.patched():
        compiled_steps(True)
        for _ in range(3):
            block(x, ids[0])
        assert compiled._last_step(block, (x, ids[0]), {}) is not None
        assert compiled._last_step(block, (x, ids[0].astype(mx.uint32)), {}) is None
        assert compiled._last_step(block, (x, mx.array([[5, 17]], dtype=mx.int32)), {}) is None
        assert compiled._last_step(block, (x,), {}) is None
        replayed = [block(x, i) for i in ids]
        compiled_steps(False)
        built = [block(x, i) for i in ids]
    assert steps_of(model) > 0 and not mx.array_equal(built[0], built[1]).item()
    for r, b in zip(replayed, built):
        assert mx.array_equal(r, b).item()


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "deepseek_v4"])
def test_layers_of_one_structure_replay_one_shared_step_each_with_its_own_weights(compiled_steps, family):
    """Two models of one config, different weights: each layer of the second takes the compiled
    step of its counterpart in the first (their structures are the same), and each model's tokens
    and logits are those it builds in Python."""
    models = [zoo.build(family, 4, seed=seed, dtype=mx.bfloat16) for seed in (0, 1)]
    with mlx_moe_fix.patched():
        compiled_steps(True)
        replayed = [decode(model, family) for model in models]
        steps = [step for model in models for _, m in model.named_modules()
                 for step in m.__dict__.get(STEPS, {}).values() if isinstance(step, compiled._Step)]
        assert len(steps) >= 4 and len(set(map(id, steps))) <= len(steps) // 2
        compiled_steps(False)
        built = [decode(model, family) for model in models]
    assert replayed[0][0] != replayed[1][0] or not mx.array_equal(replayed[0][1], replayed[1][1]).item()
    for shared, own in zip(replayed, built):
        assert shared[0] == own[0]
        assert mx.array_equal(shared[1], own[1]).item()
        assert shared[2] == own[2]


def first_blocks(family: str = "qwen3_moe", count: int = 2):
    model = zoo.build(family, 4, dtype=mx.bfloat16)
    blocks = [m for _, m in model.named_modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock"][:count]
    assert len(blocks) == count
    hidden = blocks[0].gate.scales.shape[-1] * blocks[0].gate.group_size
    return model, blocks, mx.random.normal((1, 1, hidden), key=mx.random.key(5)).astype(mx.bfloat16)


def test_a_layer_with_an_array_outside_its_module_tree_shares_no_step(compiled_steps):
    """An array kept in a module's attributes (not a parameter) would be a constant of the trace:
    that layer gets a step of its own, the others still share."""
    model, (odd, *others), x = first_blocks(count=2)
    object.__setattr__(odd.switch_mlp, "cached_array", mx.zeros((2,)))
    with mlx_moe_fix.patched():
        compiled_steps(True)
        for block in (odd, *others):
            for _ in range(3):
                block(x)
    steps = [next(s for s in b.__dict__[STEPS].values() if isinstance(s, compiled._Step)) for b in (odd, *others)]
    assert steps[0] is not steps[1]
    assert compiled._shared_key(odd, next(iter(odd.__dict__[STEPS])), compiled._layer_structure(odd)) is None
    assert len(compiled._shared_steps) == 1


def test_objects_in_a_structure_count_by_identity_while_they_live(compiled_steps):
    """A non-scalar attribute (a config object) counts by identity: layers holding the same one
    share, a layer holding an equal but other one does not, and a shared step whose object was
    freed is not taken (its id may be another object's)."""
    class Config:
        pass

    model, blocks, x = first_blocks(count=2)
    config = Config()
    for block in blocks:
        object.__setattr__(block, "config", config)
    with mlx_moe_fix.patched():
        compiled_steps(True)
        for block in blocks:
            for _ in range(3):
                block(x)
        (key, step), (other_key, other_step) = (next(iter(block.__dict__[STEPS].items())) for block in blocks)
        assert isinstance(step, compiled._Step) and other_step is step, "the same config: shared"
        object.__setattr__(blocks[1], "config", Config())
        assert compiled._shared_step(compiled._shared_key(blocks[1], other_key, compiled._layer_structure(blocks[1]))) is None, "another config: not shared"
        shared = compiled._shared_key(blocks[0], key, compiled._layer_structure(blocks[0]))
        assert compiled._shared_step(shared) is not None
        del config
        object.__setattr__(blocks[0], "config", None)
        for block in blocks:
            block(x)  # a layer's last step holds its attributes until its next call
        gc.collect()
        assert compiled._shared_step(shared) is None, "a freed object's step must not be taken"


def test_shared_steps_switched_off_give_each_layer_its_own(compiled_steps, monkeypatch):
    model, blocks, x = first_blocks(count=2)
    monkeypatch.setenv(compiled.SHARE_SWITCH, "0")
    with mlx_moe_fix.patched():
        compiled_steps(True)  # (refreshes the switches)
        for block in blocks:
            for _ in range(3):
                block(x)
    steps = [next(s for s in b.__dict__[STEPS].values() if isinstance(s, compiled._Step)) for b in blocks]
    assert steps[0] is not steps[1] and not compiled._shared_steps


def test_a_block_given_a_sharding_group_after_its_step_was_compiled_runs_upstreams_call(compiled_steps, monkeypatch):
    """The sharding check is asked only where the layer's last step does not hold: setting the
    group changes the layer's attributes, so the next call is upstream's (its all_sum runs)."""
    model, (block,), x = first_blocks(count=1)
    summed = []
    monkeypatch.setattr(mx.distributed, "all_sum", lambda y, group=None: summed.append(group) or y)
    group = object()
    with mlx_moe_fix.patched():
        compiled_steps(True)
        for _ in range(3):
            block(x)
        assert compiled._last_step(block, (x,), {}) is not None and not summed
        block.sharding_group = group
        monkeypatch.setattr("mlx_lm.models.qwen3_moe.sum_gradients", lambda g: lambda y: y)
        block(x)
        assert summed == [group], "upstream's sharded call did not run"
        block.sharding_group = None
        block(x)
        assert summed == [group]


def test_every_compiled_block_call_is_the_patched_methods_own_wrapper():
    """A patched method asks its wrapper's `last_step` before anything else (patches/methods.py):
    a compiled block reached through another wrapper's checks pays them and the step's key at
    every decode step (Inkling's block did, until its wrapper became the compiled one)."""
    from mlx_moe_fix.patches import mlx_lm, mlx_vlm

    calls = [t for t in mlx_lm.TARGETS + mlx_vlm.TARGETS if t.method == "__call__" and t.cls != "QuantizedSwitchLinear"
             and "DecoderLayer" not in t.cls and t.cls != "TransformerBlock"]
    assert {t.cls for t in calls} >= {"SwitchGLU", "Qwen3MoeSparseMoeBlock", "DeepseekV3MoE", "MoE", "InklingSparseMoE"}
    assert [t.name for t in calls if getattr(t.wrapper, "last_step", None) is not compiled._last_step] == []
