"""Prefill through Mixtral-size MoE layers sharded over a distributed group, stock and patched:
each rank holds 1 / ranks of every expert's width (as mlx-lm's `shard()` splits them) and the
layer outputs are all-summed, as a sharded MoE block does. Run it alone for one device, under
`mlx.launch` for several; rank 0 prints one JSON line.

    python3 -m benchmarks.sharded_layers                                                # 1 GPU
    mlx.launch -n 2 --backend nccl python3 -m benchmarks.sharded_layers --backend nccl  # 2 GPUs
    mlx.launch -n 2 --backend ring python3 -m benchmarks.sharded_layers --backend ring \\
        --hidden 128 --ffn 256 --experts 4 --layers 2 --tokens 64                       # CPU smoke

mlx-lm's mixtral has no `shard()`, so the layers are built here: mlx-lm SwitchGLUs (4-bit g64,
bf16, random weights, the same seed on every rank) with ffn / ranks rows per expert, routing drawn
once per run. Timed: `--layers` layers on `--tokens` tokens in one graph (median of `--reps` after
warm-up at the same shapes); tokens/s counts the prompt's tokens once.
"""

import argparse
import json
import time
from types import SimpleNamespace

import mlx.core as mx

import mlx_moe_fix

from .kernels import random_routing
from .switch_glu import quantized_switch_glu
from .timing import bench


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336, help="every expert's whole width (split over the ranks)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--backend", default="any", help="mx.distributed.init's backend")
    args = p.parse_args(argv)
    group = mx.distributed.init(backend=args.backend)
    ranks = group.size()
    if args.ffn % (64 * ranks):
        raise SystemExit(f"--ffn {args.ffn} does not split into whole 64-wide groups over {ranks} ranks")
    mx.random.seed(0)  # the same routing and activations on every rank
    x = (mx.random.normal((args.tokens, args.hidden)) * 0.5).astype(mx.bfloat16)
    indices = random_routing(args.tokens, args.experts, args.top_k)
    weights = mx.softmax(mx.random.normal(indices.shape), axis=-1).astype(mx.bfloat16)
    mx.random.seed(1 + group.rank())  # each rank its own slice of the weights
    shape = SimpleNamespace(hidden=args.hidden, ffn=args.ffn // ranks, experts=args.experts)
    layers = [quantized_switch_glu(shape) for _ in range(args.layers)]
    mx.eval(x, indices, weights)

    def forward():
        h = x
        for layer in layers:
            y = (layer(h, indices) * weights[..., None]).sum(axis=-2)
            h = mx.distributed.all_sum(y, group=group) if ranks > 1 else y
        return h

    results = {}
    for mode in ("stock", "patched"):
        if mode == "patched":
            mlx_moe_fix.apply()
        else:
            mlx_moe_fix.revert()
        started = time.perf_counter()
        timing = bench(forward, 2, args.reps)
        results[mode] = {"tokens_per_s": args.tokens / timing.median, "median_s": timing.median,
                         "first_runs_s": time.perf_counter() - started}
    mlx_moe_fix.revert()
    if group.rank() == 0:
        print(json.dumps({"ranks": ranks, "device": str(mx.default_device()), "mlx": mx.__version__,
                          "shape": vars(args), "results": results,
                          "patched_over_stock": results["patched"]["tokens_per_s"] / results["stock"]["tokens_per_s"]}),
              flush=True)


if __name__ == "__main__":
    main()
