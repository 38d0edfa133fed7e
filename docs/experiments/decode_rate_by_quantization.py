"""Fifty-first session (H200): one token through SwitchGLU experts by their quantization (affine
4-bit g64, mxfp4, nvfp4) at three families' expert shapes: stock (mlx-lm's SwitchGLU and the
weighted sum, unpatched) against moe_decode with the weights, LAYERS independent layers a graph;
GB/s over the routed experts' packed weights and scales (and biases). The times include building
the graph in Python. Result: docs/benchmarks.md, fifty-first session, item 5. Run from the repo
root (SMOKE=1: a tiny shape, on a CPU):
    LAYERS=12 PYTHONPATH=. python3 docs/experiments/decode_rate_by_quantization.py"""
import os, sys
os.environ["MLX_MOE_FIX_REFERENCES"] = "0"
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU
import mlx_moe_fix
from mlx_moe_fix.kernels import ExpertLinear, MoEExperts, moe_decode
from mlx_moe_fix.patches.activations import recognise
from benchmarks.timing import bench

SHAPES = {"inkling": (6144, 3072, 6, 8), "gpt_oss": (2880, 2880, 4, 8), "qwen3": (2048, 768, 8, 16)}
MODES = {"affine": dict(group_size=64, bits=4, mode="affine"), "mxfp4": dict(group_size=32, bits=4, mode="mxfp4"),
         "nvfp4": dict(group_size=16, bits=4, mode="nvfp4")}
layers = int(os.environ.get("LAYERS", 16))
if os.environ.get("SMOKE"):
    SHAPES = {"tiny": (256, 128, 2, 4)}
rows = []
for shape, (hidden, ffn, k, experts) in SHAPES.items():
    for mode, q in MODES.items():
        mx.random.seed(0)
        blocks, described, routes = [], [], []
        for _ in range(layers):
            layer = SwitchGLU(hidden, ffn, experts)
            layer.set_dtype(mx.bfloat16)
            nn.quantize(layer, **q)
            mx.eval(layer.parameters())
            blocks.append(layer)
            described.append(MoEExperts(tuple(ExpertLinear.from_module(layer[n]) for n in ("gate_proj", "up_proj", "down_proj")),
                                        recognise(layer.activation)))
            idx = mx.random.permutation(experts)[:k].astype(mx.uint32).reshape(1, k)
            w = mx.softmax(mx.random.normal((1, k)), axis=-1).astype(mx.bfloat16)
            routes.append((idx, w))
        x = mx.random.normal((1, hidden)).astype(mx.bfloat16)
        mx.eval(x, routes)
        per_expert = sum(sum(v.nbytes for v in (p.weight, p.scales, p.biases) if v is not None) for p in described[0].projections) / experts
        moved = per_expert * k * layers

        def stock():
            return [(b(x, i) * w[..., None]).sum(-2) for b, (i, w) in zip(blocks, routes)]

        def ours():
            return [moe_decode(x, i, e, w) for e, (i, w) in zip(described, routes)]

        mlx_moe_fix.revert()
        ref = stock()
        got = ours()
        err = max(float((mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max() / (mx.abs(b.astype(mx.float32)).max() + 1e-6)).item()) for a, b in zip(got, ref))
        times = {}
        for name, fn in (("stock", stock), ("ours", ours), ("stock", stock), ("ours", ours)):
            s = bench(fn, warmup=3, reps=20)
            times.setdefault(name, []).append(s.median)
        t_stock, t_ours = min(times["stock"]), min(times["ours"])
        rows.append((shape, mode, k, per_expert * k / 1e6, t_stock / layers * 1e6, t_ours / layers * 1e6, moved / t_stock / 1e9, moved / t_ours / 1e9, t_stock / t_ours, err))
        print(rows[-1], file=sys.stderr, flush=True)
print(f"decode, one token, {layers} independent layers a graph (SwitchGLU experts, top-k weighted combine), medians of 20 after 3 warm-ups, better of two rounds")
print("| shape | experts | k | MB read / layer | stock µs / layer | ours µs / layer | stock GB/s | ours GB/s | ours / stock | max rel err |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.1f} | {r[6]:.0f} | {r[7]:.0f} | {r[8]:.2f} | {r[9]:.1e} |")
