"""Greedy tokens of a zoo model sharded over a distributed group, stock and patched, beside the
same model unsharded: run under `mlx.launch`, one process per rank.

    mlx.launch -n 2 --backend ring python3 -m benchmarks.sharded_tokens --backend ring   # CPU
    mlx.launch -n 2 --backend nccl python3 -m benchmarks.sharded_tokens --backend nccl   # 2 GPUs

The family's expert widths must split into whole quantization groups per rank: of the zoo, gpt_oss
and qwen3_moe (128 wide, 2 groups of 64) do for two ranks; mlx-lm's mixtral has no shard().

Every rank builds the same seeded model, `model.shard(group)` splits its expert projections
across the ranks (upstream's sharding: each rank holds a slice of every expert's width and the
MoE block all-sums), and rank 0 prints one JSON line: the unsharded tokens, the sharded stock and
patched tokens, and the ops' paths, so that a caller can compare them.
"""

import argparse
import json

import mlx.core as mx

import mlx_moe_fix
from mlx_moe_fix import zoo


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
    unsharded = zoo.greedy_tokens(whole, prompt, args.tokens)
    model = zoo.build(args.family, args.bits, dtype=dtype)
    model.shard(group)
    # Rows of the first MoE layer's first projection: each expert's width on this rank.
    widths = [zoo.moe_layers(m)[0][1].gate_proj.weight.shape[-2] for m in (whole, model)]
    stock = zoo.greedy_tokens(model, prompt, args.tokens)
    mlx_moe_fix.reset_path_counts()
    with mlx_moe_fix.patched():
        patched = zoo.greedy_tokens(model, prompt, args.tokens)
    paths = sorted({(r.layer, r.phase, r.path) for r in mlx_moe_fix.path_counts()})
    if group.rank() == 0:
        print(json.dumps({"ranks": group.size(), "device": str(mx.default_device()), "expert_widths": widths,
                          "unsharded": unsharded, "stock": stock, "patched": patched, "paths": paths}), flush=True)


if __name__ == "__main__":
    main()
