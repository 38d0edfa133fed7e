"""Issue 4's memory criterion ("no dequantised copy of the expert weights: peak memory stays within
stock + O(tokens x hidden)"), measured: one quantized SwitchGLU layer (4-bit g64, bf16) with random
routing, prefilled as a MoE block calls its experts (the experts and the weighted top-k combine),
stock (mlx-lm's SwitchGLU, the combine as its blocks write it) against `moe_prefill` (on CUDA our
kernels, elsewhere the reference; the table says which). Per case: what the call allocates above the
memory resident before it (MLX's peak during its evaluation, less the active bytes before), in MB
and in units of the layer's activations (tokens x hidden x 2 bytes), with the experts' weight bytes
for scale: a dequantised bf16 copy of them would add about 3.6x those (4-bit g64).

    python3 -m benchmarks.prefill_memory --cases qwen3:512,qwen3:2048,qwen3:8192,mixtral:2048

Each call runs once before it is measured (MLX's and NVRTC's compiles are not measured), and MLX's
buffer cache is cleared before each measurement.
"""

import argparse
from types import SimpleNamespace

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_moe_fix.kernels.moe_prefill import moe_prefill, moe_prefill_implementation

from .kernels import random_routing
from .prefill_ab import SHAPES
from .switch_glu import experts_of, quantized_switch_glu
from .timing import environment, environment_line, fmt, log, markdown_table

MB = 1e6
# (hidden, intermediate, experts, top-k): prefill_ab's, and small ones for the CPU (with many
# experts, few tokens pad most of their rows: the grid's worst case, moe_prefill.grid_tiles)
CASE_SHAPES = {**SHAPES, "small": (256, 128, 16, 4), "small_256_experts": (256, 128, 256, 8)}


def extra_peak_bytes(call) -> int:
    """The bytes `call()`'s evaluation allocates above the memory active before it: MLX's peak
    memory during the evaluation, less the active bytes before (its inputs evaluated already)."""
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(call())
    mx.synchronize()
    return mx.get_peak_memory() - before


def stock_prefill(layer, x, indices, weights):
    """mlx-lm's blocks: SwitchGLU's [..., k, hidden] rows, weighted and summed over k."""
    return (layer(x, indices) * weights[..., None]).sum(axis=-2)


def parse_cases(text: str) -> list:
    cases = []
    for item in text.split(","):
        shape, tokens = item.split(":")
        if shape not in CASE_SHAPES:
            raise SystemExit(f"unknown shape {shape!r}: one of {', '.join(CASE_SHAPES)}")
        cases.append((shape, int(tokens)))
    return cases


def build_case(shape: str, tokens: int) -> SimpleNamespace:
    """The layer of `shape` (CASE_SHAPES), its MoEExperts, and `tokens` tokens' activations, random
    routing and routing weights, evaluated."""
    hidden, ffn, experts, top_k = CASE_SHAPES[shape]
    layer = quantized_switch_glu(SimpleNamespace(hidden=hidden, ffn=ffn, experts=experts))
    x = (mx.random.normal((1, tokens, hidden)) * 0.5).astype(mx.bfloat16)
    indices = random_routing(tokens, experts, top_k).reshape(1, tokens, top_k)
    weights = mx.softmax(mx.random.normal((1, tokens, top_k)), axis=-1).astype(mx.bfloat16)
    mx.eval(x, indices, weights)
    return SimpleNamespace(layer=layer, experts=experts_of(layer), x=x, indices=indices, weights=weights,
                           activations=tokens * hidden * x.itemsize,
                           weight_bytes=sum(v.nbytes for _, v in tree_flatten(layer.parameters())))


def stock_and_patched_bytes(case: SimpleNamespace, patched=moe_prefill) -> tuple:
    """extra_peak_bytes of stock's prefill and of `patched` (moe_prefill's signature) on `case`,
    each run once before it is measured (MLX's and NVRTC's compiles apart)."""
    calls = (lambda: stock_prefill(case.layer, case.x, case.indices, case.weights),
             lambda: patched(case.x, case.indices, case.experts, case.weights))
    measured = []
    for call in calls:
        mx.eval(call())
        measured.append(extra_peak_bytes(call))
    return tuple(measured)


def measure_case(shape: str, tokens: int) -> dict:
    case = build_case(shape, tokens)
    stock, patched = stock_and_patched_bytes(case)
    return {"shape": shape, "tokens": tokens, "path": moe_prefill_implementation(case.experts, case.x.dtype).path,
            "stock": stock, "patched": patched, "activations": case.activations, "weights": case.weight_bytes}


def table(rows: list) -> str:
    header = ["case", "patched runs", "stock MB", "patched MB", "patched - stock, MB",
              "(patched - stock) / activations", "expert weights MB"]
    body = [[f"{r['shape']} T={r['tokens']}", r["path"], fmt(r["stock"] / MB), fmt(r["patched"] / MB),
             fmt((r["patched"] - r["stock"]) / MB), fmt((r["patched"] - r["stock"]) / r["activations"]),
             fmt(r["weights"] / MB)] for r in rows]
    return markdown_table(header, body)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="qwen3:512,qwen3:2048,qwen3:8192,mixtral:512,mixtral:2048",
                        help="shape:tokens, comma-separated (shapes: %s)" % ", ".join(CASE_SHAPES))
    args = parser.parse_args(argv)
    log(environment_line(environment()))
    rows = []
    for shape, tokens in parse_cases(args.cases):
        log(f"[prefill_memory] {shape} T={tokens}")
        rows.append(measure_case(shape, tokens))
    print(table(rows))


if __name__ == "__main__":
    main()
