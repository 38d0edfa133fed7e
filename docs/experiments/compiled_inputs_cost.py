"""Seventy-fourth stop (docs/benchmarks.md, item 6): the host cost of a compiled call's captured
inputs, as patches/compiled.py's `_Step` passes a MoE block's arrays: its module tree (what
`_Step` captures), a flat list of the same 12 arrays, or no inputs; a trivial traced body, build
only (no evaluation), µs a call, medians. CPU or GPU alike (the flattening is host work).

    python3 docs/experiments/compiled_inputs_cost.py
"""

import statistics
import time

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_moe


def timed(call, n=20000, rounds=7) -> float:
    runs = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            call()
        runs.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(runs)


def main():
    args = qwen3_moe.ModelArgs(
        model_type="qwen3_moe", hidden_size=256, num_hidden_layers=1, intermediate_size=512, num_attention_heads=4,
        num_experts=16, num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=128,
        rms_norm_eps=1e-6, vocab_size=1000, num_key_value_heads=4, head_dim=64, rope_theta=1e6,
        tie_word_embeddings=False, max_position_embeddings=4096, norm_topk_prob=True)
    block = qwen3_moe.Qwen3MoeSparseMoeBlock(args)
    nn.quantize(block, group_size=64, bits=4)
    mx.eval(block.parameters())
    arrays = [value for _, value in tree_flatten(block.parameters())]
    x = mx.random.normal((1, 1, 256)).astype(mx.bfloat16)
    tree_inputs, flat_inputs = [], []
    by_tree = mx.compile(lambda x: x * 2 + 1, inputs=tree_inputs)
    by_list = mx.compile(lambda x: x * 2 + 1, inputs=flat_inputs)
    bare = mx.compile(lambda x: x * 2 + 1)

    def tree_call():
        tree_inputs[:] = block.values()
        out = by_tree(x)
        tree_inputs.clear()
        return out

    def list_call():
        flat_inputs[:] = arrays
        out = by_list(x)
        flat_inputs.clear()
        return out

    calls = {"module tree": tree_call, "flat list": list_call, "no inputs": lambda: bare(x)}
    print(f"{len(arrays)} arrays in the block; MLX {mx.__version__}, {mx.default_device()}")
    for name, call in calls.items():
        call(), call()
        print(f"{name}: {timed(call):.2f} µs a call")


if __name__ == "__main__":
    main()
