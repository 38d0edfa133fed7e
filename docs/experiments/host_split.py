"""Session 32 (docs/benchmarks.md, thirty-second session, item 3): on the GPU machine's host, a
full-size Qwen3-30B-A3B MoE block (4-bit experts, 8-bit router as mlx-lm
quantizes mlp.gate) and its dense equivalent's MLP (qwen3, intermediate 6144, 4-bit), built
without evaluation in a loop: the patched call, its compiled step called directly, pieces of
the wrapper (the last rows: the expressions _last_step's check is made of, and the two id tuples
it built before a645941), the dense MLP's call; µs a call, median of rounds. Then the GPU's SM
count as the CUDA driver gives it and the one-wave rule of the fused router at two shapes.
    source .mlx-cuda/setup.sh && python3 docs/experiments/host_split.py"""
import statistics, time
import mlx.core as mx
import mlx.nn as nn
import mlx_moe_fix
from mlx_lm.models import qwen3_moe, qwen3
from mlx_moe_fix.patches import compiled

args = qwen3_moe.ModelArgs(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=1, intermediate_size=6144,
                           num_attention_heads=32, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
                           mlp_only_layers=[], moe_intermediate_size=768, rms_norm_eps=1e-6, vocab_size=1000,
                           num_key_value_heads=4, head_dim=128, rope_theta=1e6, tie_word_embeddings=False,
                           max_position_embeddings=4096, norm_topk_prob=True)
block = qwen3_moe.Qwen3MoeSparseMoeBlock(args)
block.set_dtype(mx.bfloat16)
nn.quantize(block, group_size=64, bits=4, class_predicate=lambda p, m: hasattr(m, "to_quantized") and p != "gate")
nn.quantize(block, group_size=64, bits=8, class_predicate=lambda p, m: p == "gate")
mlp = qwen3.MLP(2048, 6144)
mlp.set_dtype(mx.bfloat16)
nn.quantize(mlp, group_size=64, bits=4)
mx.eval(block.parameters(), mlp.parameters())
x = mx.random.normal((1, 1, 2048)).astype(mx.bfloat16)
mx.eval(x)
mlx_moe_fix.apply()
for _ in range(5):
    mx.eval(block(x), mlp(x))
print("fused router:", mlx_moe_fix.status()["routed_decode_router_inside"])
step = block.__dict__["_mlx_moe_fix_last_step"].step


def timeit(f, n=2000, rounds=9):
    out = []
    for _ in range(rounds):
        kept = []
        t = time.perf_counter()
        for _ in range(n):
            kept.append(f())
        out.append((time.perf_counter() - t) / n * 1e6)
        del kept
    return statistics.median(out)


def direct():
    step.children[:] = block.values()
    step.caller[0] = block
    r = step.compiled(x)
    step.caller[0] = None
    step.children.clear()
    return r


args1 = (x,)
rows = [("patched block call", lambda: block(x)), ("its compiled step, directly", direct),
        ("_Step.__call__", lambda: step(block, args1, {})), ("_last_step", lambda: compiled._last_step(block, args1, {})),
        ("dense MLP call", lambda: mlp(x)), ("one 4-bit QuantizedLinear (2048 -> 6144)", lambda: mlp.gate_proj(x))]
from mlx_moe_fix.patches.compiled import _state, options
from mlx_moe_fix.env import snapshot as env_snapshot
last = block.__dict__["_mlx_moe_fix_last_step"]
rows += [("instance.__dict__.get", lambda: block.__dict__.get("_mlx_moe_fix_last_step")),
         ("getattr(_state, nested)", lambda: getattr(_state, "nested", False)),
         ("x.shape != last.shape", lambda: x.shape != last.shape), ("x.dtype != last.dtype", lambda: x.dtype != last.dtype),
         ("snapshot()", lambda: env_snapshot() is not last.switches), ("options.enabled()", lambda: options.enabled() != last.enabled),
         ("mx.default_device() != last.device", lambda: mx.default_device() != last.device),
         ("mx.default_device()", lambda: mx.default_device()),
         ("ids of values", lambda: tuple(map(id, block.values())) != last.children),
         ("ids of vars", lambda: tuple(map(id, vars(block).values())) != last.attributes)]
for name, f in rows:
    print(f"| {name} | {timeit(f):.2f} |")

from types import SimpleNamespace
import sys
R = sys.modules["mlx_moe_fix.kernels.moe_routed_decode"]
import ctypes
try:
    d = ctypes.CDLL("libcuda.so.1")
    dev, n = ctypes.c_int(), ctypes.c_int()
    print("cuInit", d.cuInit(0), "cuDeviceGet", d.cuDeviceGet(ctypes.byref(dev), 0), "attr", d.cuDeviceGetAttribute(ctypes.byref(n), 16, dev), n.value)
except Exception as e:
    print("ctypes:", repr(e))
print("SMs", R.multiprocessor_count(), "one wave", R.one_wave_blocks(), mx.default_device(), mx.default_device().type, mx.gpu)
for name, rows, k in (("qwen3", 768, 8), ("mixtral", 14336, 2)):
    e = SimpleNamespace(projections=[SimpleNamespace(output_dims=rows)] * 3)
    print(name, R.fused_router_blocks(e, k), R._waves_reason(e, k))
