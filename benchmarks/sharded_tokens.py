"""Greedy tokens of a zoo model sharded over a distributed group, stock and patched, beside the
same model unsharded: run under `mlx.launch`, one process per rank.

    mlx.launch -n 2 --backend ring python3 -m benchmarks.sharded_tokens --backend ring   # CPU
    mlx.launch -n 2 --backend nccl python3 -m benchmarks.sharded_tokens --backend nccl   # 2 GPUs

The family's expert widths must split into whole quantization groups per rank: of the zoo, gpt_oss
and qwen3_moe (256 wide, 4 groups of 64) do for two ranks; mlx-lm's mixtral has no shard().

Every rank builds the same seeded model, `model.shard(group)` splits its expert projections
across the ranks (upstream's sharding: each rank holds a slice of every expert's width and the
MoE block all-sums), and rank 0 prints one JSON line: the unsharded tokens, the sharded stock and
patched tokens, and the ops' paths, so that a caller can compare them.

In bf16 (the GPU) a sharded model sums its MoE outputs in another order than the unsharded one,
and random models have near-ties, so even stock's sharded tokens may part from the unsharded
ones. Hence also, per sharded run, a teacher-forced comparison against the unsharded stream (fed
the unsharded tokens): `forced` holds the steps whose unsharded choice is clear
(zoo.clear_steps), how many of those the sharded run chose alike, and the largest relative error
of a step's logits. And, since a stock sharded run may not reproduce itself
(`stock_reproducible`: a second stock run's tokens equal the first's), `replay`: every MoE layer
call of a sharded stock run, replayed on its recorded inputs (zoo.replayed_layer_calls) on this
rank, stock against patched (the calls are local to the rank; the all-sum follows them in the
block), with the largest relative error over the calls of finite output.
"""

import argparse
import json

import mlx.core as mx

import mlx_moe_fix
from mlx_moe_fix import zoo

from .timing import relative_error


def layer_call_replay(model, prompt, n) -> dict:
    """Every MoE layer call of a stock greedy run, replayed stock and patched."""
    recorded, replayed = zoo.replayed_layer_calls(model, prompt, n)
    errors = [relative_error(patched, stock) for _, _, stock, patched in replayed]
    return {"calls": recorded, "compared": len(errors), "max_relative_error": max(errors, default=None)}


def forced_agreement(model, prompt, tokens, logits) -> dict:
    """The sharded `model` fed the unsharded `tokens` (whose logits are `logits`): its choices
    at the clear steps, and its logits' largest relative error."""
    choices, forced_logits = zoo.forced_decode(model, prompt, tokens)
    clear = zoo.clear_steps(logits)
    error = mx.sqrt(mx.sum((forced_logits - logits) ** 2, axis=-1) / mx.sum(logits**2, axis=-1))
    return {"clear_steps": sum(clear), "clear_steps_alike": sum(c and a == b for c, a, b in zip(clear, choices, tokens)),
            "max_logits_relative_error": mx.max(error).item()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="gpt_oss", choices=zoo.FAMILIES)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--backend", default="any", help="mx.distributed.init's backend")
    args = p.parse_args(argv)
    group = mx.distributed.init(strict=True, backend=args.backend)
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    prompt = zoo.prompt_for(args.family)
    whole = zoo.build(args.family, args.bits, dtype=dtype)
    unsharded, unsharded_logits = zoo.greedy_decode(whole, prompt, args.tokens)
    model = zoo.build(args.family, args.bits, dtype=dtype)
    model.shard(group)
    # Rows of the first MoE layer's first projection: each expert's width on this rank.
    widths = [zoo.moe_layers(m)[0][1].gate_proj.weight.shape[-2] for m in (whole, model)]
    stock = zoo.greedy_tokens(model, prompt, args.tokens)
    stock_reproducible = zoo.greedy_tokens(model, prompt, args.tokens) == stock
    replay = layer_call_replay(model, prompt, args.tokens)
    forced = {"stock": forced_agreement(model, prompt, unsharded, unsharded_logits)}
    mlx_moe_fix.reset_path_counts()
    with mlx_moe_fix.patched():
        patched = zoo.greedy_tokens(model, prompt, args.tokens)
        forced["patched"] = forced_agreement(model, prompt, unsharded, unsharded_logits)
    paths = sorted({(r.layer, r.phase, r.path) for r in mlx_moe_fix.path_counts()})
    if group.rank() == 0:
        print(json.dumps({"ranks": group.size(), "device": str(mx.default_device()), "expert_widths": widths,
                          "unsharded": unsharded, "stock": stock, "patched": patched, "forced": forced,
                          "stock_reproducible": stock_reproducible, "replay": replay,
                          "paths": paths}), flush=True)


if __name__ == "__main__":
    main()
