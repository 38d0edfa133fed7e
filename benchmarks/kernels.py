"""Expert-matmul microbenchmarks: stock `mx.gather_qmm` against mlx_moe_fix at MoE shapes.

Run from the repo root (on the GPU machine after `source .mlx-cuda/setup.sh`):

    python3 -m benchmarks.kernels                                    # every shape, T = 1 .. 8192
    python3 -m benchmarks.kernels --shapes qwen3,mixtral --tokens 1,16,2048 --json /tmp/k.json
    python3 -m benchmarks.kernels --no-block --torch off             # projections only, no torch
    python3 -m benchmarks.kernels --smoke --json /tmp/k.json         # tiny sizes, seconds on CPU

Every case is one expert projection hidden -> ffn (the gate/up shape) over T tokens routed to
top-k of E experts, 4-bit affine weights with group size 64, bf16 activations, random weights
and random (distinct per token) routing. FLOPs are 2 * T * k * hidden * ffn. Columns:

- stock unsorted / sorted: `mx.gather_qmm` as mlx-lm's SwitchGLU calls it; "sorted" includes
  SwitchGLU's argsort / gather / unsort around the call. "stock" in the ratio is the variant
  SwitchGLU picks at that size (sorted once T * k >= 64).
- ours: the op mlx_moe_fix's dispatcher picks at that size (`moe_prefill` from
  PREFILL_MIN_PAIRS (token, expert) pairs on, `moe_decode` below) on
  `MoEExperts((ExpertLinear(...),))`; "other op" is the one it did not pick, timed too where
  T * k <= --decode-max-pairs, to check where the dispatch threshold belongs.
- gather_mm bf16 sorted, dense quantized_matmul and dense bf16 matmul at equal FLOPs
  ([T * k, hidden] x [hidden, ffn]); torch._grouped_mm bf16 on rows already sorted by expert
  (prefill rows only), timed with CUDA events in a child process where torch with CUDA imports
  (benchmarks/torch_grouped_mm.py: torch's CUDA libraries never load next to MLX's).

Small T (<= --chain-max-tokens) is decode: one timed graph evaluates --layers independent
layers, each with its own weight arrays and routing (so caches cannot hide the HBM traffic),
and the time is divided by the layer count. Its GB/s counts the packed weights + scales +
biases of the distinct experts each layer routes to. Per-layer times include building the
graph in Python, which mlx-lm overlaps with GPU work during decode: they are upper bounds.
Larger T is prefill: one timed graph evaluates --prefill-layers independent layers (default 4),
so that one eval round trip is not charged whole to a sub-millisecond kernel.

Unless --no-block, the same sizes run a whole quantized mlx-lm `SwitchGLU` (gate, up,
down) stock and patched, switching with `mlx_moe_fix.revert()` / `apply()` in this process.
"""

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU, _gather_sort, _scatter_unsort

import mlx_moe_fix
from mlx_moe_fix.kernels import (
    PREFILL_MIN_PAIRS,
    ExpertLinear,
    MoEExperts,
    moe_decode,
    moe_prefill,
)

from .timing import (
    Progress,
    Stats,
    bench,
    environment,
    environment_line,
    fmt,
    log,
    markdown_table,
    take_path_counts,
    write_json,
)

GROUP_SIZE = 64
BITS = 4
# Relative error above this between ours and stock means the fast path computes something
# else: bf16 operands land between 1e-3 and 1e-2 (METHOD.md), different accumulation
# orders included.
REL_ERR_LIMIT = 2e-2


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    ffn: int
    experts: int
    top_k: int


SHAPES = {
    "qwen3": Shape("Qwen3-30B-A3B", 2048, 768, 128, 8),
    "mixtral": Shape("Mixtral-8x7B", 4096, 14336, 8, 2),
    "deepseek": Shape("DeepSeek-V3-like", 7168, 2048, 256, 8),
    "gpt-oss": Shape("gpt-oss-20b", 2880, 2880, 32, 4),
}
SMOKE_SHAPES = {"tiny": Shape("tiny", 128, 192, 8, 2)}
DEFAULT_TOKENS = [1, 4, 16, 128, 512, 2048, 8192]


def quantized_bytes(out_dims: int, in_dims: int) -> int:
    """Bytes of one [out, in] matrix as mx.quantize stores it: packed weight + bf16 scales
    and biases."""
    return out_dims * in_dims * BITS // 8 + 2 * out_dims * (in_dims // GROUP_SIZE) * 2


def random_quantized(experts: int, out_dims: int, in_dims: int):
    """Random [experts, out, in] weights, quantized; generated in bf16 so that no float32
    copy of a multi-GB expert tensor is ever made."""
    w = mx.random.normal((experts, out_dims, in_dims), dtype=mx.bfloat16)
    w = w * (in_dims**-0.5)
    wq, scales, biases = mx.quantize(w, GROUP_SIZE, BITS)
    mx.eval(wq, scales, biases)
    return wq, scales, biases


def random_routing(tokens: int, experts: int, top_k: int) -> mx.array:
    """top_k distinct experts per token, uniformly at random: [tokens, top_k] uint32."""
    scores = mx.random.uniform(shape=(tokens, experts))
    return mx.argpartition(scores, kth=experts - top_k, axis=-1)[:, experts - top_k :].astype(
        mx.uint32
    )


def balanced_routing(tokens: int, experts: int, top_k: int) -> mx.array:
    """top_k distinct experts per token, token t taking experts (t top_k + j) mod `experts`: every
    expert gets tokens * top_k / experts pairs where that divides (and where that is a multiple of
    the prefill's tile, no expert's run ends in a partial tile). [tokens, top_k] uint32;
    top_k <= experts."""
    if top_k > experts:
        raise ValueError(f"top_k {top_k} > experts {experts}: a token's experts would repeat")
    slots = mx.arange(tokens)[:, None] * top_k + mx.arange(top_k)[None, :]
    return (slots % experts).astype(mx.uint32)


def distinct_experts(indices: mx.array) -> int:
    return int(np.unique(np.array(indices)).size)


@dataclass
class Layer:
    """One layer's expert projection plus a dense matrix of the same [ffn, hidden] shape."""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    experts: MoEExperts
    dense_q: tuple
    dense_bf16: mx.array
    indices: Optional[mx.array] = None
    # Only the layers a prefill row times carry the dequantized experts (bf16 gather_mm column).
    experts_bf16: Optional[mx.array] = None


def build_layers(shape: Shape, count: int, bf16_layers: int) -> List[Layer]:
    """`count` layers, the first `bf16_layers` of them with their experts also dequantized to bf16."""
    layers = []
    for i in range(count):
        w, s, b = random_quantized(shape.experts, shape.ffn, shape.hidden)
        dense_q = random_quantized(1, shape.ffn, shape.hidden)
        dense_q = tuple(a[0] for a in dense_q)
        dense_bf16 = mx.random.normal((shape.hidden, shape.ffn), dtype=mx.bfloat16)
        dense_bf16 = dense_bf16 * (shape.hidden**-0.5)
        experts = MoEExperts((ExpertLinear(w, s, b, group_size=GROUP_SIZE, bits=BITS),))
        layer = Layer(w, s, b, experts, dense_q, dense_bf16)
        if i < bf16_layers:
            layer.experts_bf16 = mx.dequantize(w, s, b, GROUP_SIZE, BITS)
        mx.eval(layer.dense_bf16, [] if layer.experts_bf16 is None else layer.experts_bf16)
        layers.append(layer)
    return layers


# ---- the measured functions: (x [T, hidden], x_rows [T * k, hidden], layer) -> array ----


def stock_unsorted(x, x_rows, layer):
    return mx.gather_qmm(
        mx.expand_dims(x, (-2, -3)),
        layer.weight,
        layer.scales,
        layer.biases,
        rhs_indices=layer.indices,
        transpose=True,
        group_size=GROUP_SIZE,
        bits=BITS,
    )


def stock_sorted(x, x_rows, layer):
    xs, idx, inv_order = _gather_sort(mx.expand_dims(x, (-2, -3)), layer.indices)
    y = mx.gather_qmm(
        xs,
        layer.weight,
        layer.scales,
        layer.biases,
        rhs_indices=idx,
        transpose=True,
        group_size=GROUP_SIZE,
        bits=BITS,
        sorted_indices=True,
    )
    return _scatter_unsort(y, inv_order, layer.indices.shape)


def ours_prefill(x, x_rows, layer):
    return moe_prefill(x, layer.indices, layer.experts)


def ours_decode(x, x_rows, layer):
    return moe_decode(x, layer.indices, layer.experts)


def gather_mm_bf16_sorted(x, x_rows, layer):
    xs, idx, inv_order = _gather_sort(mx.expand_dims(x, (-2, -3)), layer.indices)
    y = mx.gather_mm(xs, layer.experts_bf16.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=True)
    return _scatter_unsort(y, inv_order, layer.indices.shape)


def dense_qmm(x, x_rows, layer):
    w, s, b = layer.dense_q
    return mx.quantized_matmul(x_rows, w, s, b, transpose=True, group_size=GROUP_SIZE, bits=BITS)


def dense_bf16(x, x_rows, layer):
    return x_rows @ layer.dense_bf16


PROJECTION_FUNCTIONS: Dict[str, Callable] = {
    f.__name__: f
    for f in (
        stock_unsorted,
        stock_sorted,
        ours_prefill,
        ours_decode,
        gather_mm_bf16_sorted,
        dense_qmm,
        dense_bf16,
    )
}


def projection_methods(tokens: int, top_k: int, args) -> List[str]:
    """The MLX methods one projection case times (torch comes on top, prefill only)."""
    names = ["stock_unsorted", "stock_sorted", "ours_prefill"]
    if ours_choice(tokens, top_k) == "ours_decode" or tokens * top_k <= args.decode_max_pairs:
        names.append("ours_decode")
    if tokens > args.chain_max_tokens and not args.no_bf16_gather:
        names.append("gather_mm_bf16_sorted")
    return names + ["dense_qmm", "dense_bf16"]


def torch_case(key: str, shape: Shape, indices: mx.array, args) -> Dict[str, Any]:
    """What benchmarks/torch_grouped_mm.py needs to time the same routing in torch."""
    counts = np.bincount(np.array(indices).reshape(-1), minlength=shape.experts)
    return {
        "key": key,
        "hidden": shape.hidden,
        "ffn": shape.ffn,
        "counts": counts.tolist(),
        "warmup": args.warmup,
        "reps": args.reps,
        "max_seconds": args.max_seconds,
    }


def run_torch_cases(requests: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Times the torch column in a child process (see benchmarks/torch_grouped_mm.py):
    {"torch": version, "results": {key: ...}} or {"error": why}."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.torch_grouped_mm"],
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # the repo root
            input=json.dumps(requests),
            capture_output=True,
            text=True,
            timeout=120 + sum(r["max_seconds"] * 1.5 for r in requests),
        )
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    if done.returncode != 0 or not done.stdout.strip():
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-2000:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def stats_dict(stats: Stats, layers: int, flops: float = 0, weight_bytes: float = 0):
    """Per-layer seconds and the rates they imply. `build_s` is the Python graph building
    inside `median_s`; `gbps` counts the device part only (median_s - build_s), which is what
    a decode step costs once mlx-lm overlaps building with the device."""
    d = {
        "median_s": stats.median / layers,
        "min_s": stats.min / layers,
        "max_s": stats.max / layers,
        "build_s": stats.build_median / layers,
        "spread": stats.spread,
        "reps": stats.reps,
    }
    if flops:
        d["tflops"] = flops / d["median_s"] / 1e12
    if weight_bytes:
        d["gbps"] = weight_bytes / max(d["median_s"] - d["build_s"], 1e-12) / 1e9
    return d


def rel_err(out: mx.array, ref: mx.array) -> float:
    out = out.astype(mx.float32).reshape(ref.shape)
    ref = ref.astype(mx.float32)
    err = mx.linalg.norm((out - ref).flatten()) / mx.linalg.norm(ref.flatten())
    return float(err.item())


@dataclass
class Case:
    """What one (shape, T) row measured."""

    kind: str
    shape: Shape
    tokens: int
    mode: str  # "decode" (chained layers) or "prefill"
    layers: int
    flops: float
    methods: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    stock_method: str = ""
    ours_method: str = ""
    rel_err: Dict[str, float] = field(default_factory=dict)
    paths: Dict[str, int] = field(default_factory=dict)  # mlx_moe_fix's, patched blocks only
    errors: Dict[str, str] = field(default_factory=dict)  # methods that raised, with the message

    @property
    def key(self) -> str:
        return f"{self.shape.name}:{self.tokens}"

    def ratio(self) -> Optional[float]:
        stock = self.methods.get(self.stock_method, {}).get("median_s")
        ours = self.methods.get(self.ours_method, {}).get("median_s")
        return stock / ours if stock and ours else None

    def to_dict(self) -> Dict[str, Any]:
        return {
            "kind": self.kind,
            "shape": self.shape.name,
            "hidden": self.shape.hidden,
            "ffn": self.shape.ffn,
            "experts": self.shape.experts,
            "top_k": self.shape.top_k,
            "tokens": self.tokens,
            "mode": self.mode,
            "layers": self.layers,
            "flops": self.flops,
            "methods": self.methods,
            "stock_method": self.stock_method,
            "ours_method": self.ours_method,
            "speedup": self.ratio(),
            "rel_err": self.rel_err,
            "paths": self.paths,
            "errors": self.errors,
        }


def pool_size(shape: Shape, bytes_per_layer: int, args) -> int:
    """How many independent layers to build: --layers for decode rows to chain, --prefill-layers
    for prefill rows, capped by --pool-gb."""
    wanted = args.prefill_layers
    if any(t <= args.chain_max_tokens for t in args.tokens):
        wanted = max(wanted, args.layers)
    return max(1, min(wanted, int(args.pool_gb * 1e9 // bytes_per_layer)))


def stock_choice(tokens: int, top_k: int) -> str:
    """The variant mlx-lm's SwitchGLU runs at this size: it sorts from 64 (token, expert)
    pairs on."""
    return "stock_sorted" if tokens * top_k >= 64 else "stock_unsorted"


def ours_choice(tokens: int, top_k: int) -> str:
    """The op mlx_moe_fix's dispatcher runs at this size."""
    return "ours_prefill" if tokens * top_k >= PREFILL_MIN_PAIRS else "ours_decode"


def run_projection_cases(
    shape: Shape, args, torch_requests: List[Dict[str, Any]], progress: Progress
) -> List[Case]:
    """Every T for one shape; adds what the torch column should time to torch_requests."""
    per_expert = quantized_bytes(shape.ffn, shape.hidden)
    count = pool_size(shape, shape.experts * per_expert, args)
    log(f"[kernels] {shape.name}: building {count} layer(s) of expert weights")
    pool = build_layers(shape, count, bf16_layers=0 if args.no_bf16_gather else args.prefill_layers)
    cases = []
    for tokens in args.tokens:
        decode = tokens <= args.chain_max_tokens
        layers = pool if decode else pool[: args.prefill_layers]
        for layer in layers:
            layer.indices = random_routing(tokens, shape.experts, shape.top_k)
        x = mx.random.normal((tokens, shape.hidden), dtype=mx.bfloat16)
        x_rows = mx.random.normal((tokens * shape.top_k, shape.hidden), dtype=mx.bfloat16)
        mx.eval(x, x_rows, [layer.indices for layer in layers])

        flops = 2.0 * tokens * shape.top_k * shape.hidden * shape.ffn
        # Mean over the chained layers of the expert bytes each one has to read.
        expert_bytes = per_expert * np.mean([distinct_experts(l.indices) for l in layers])
        case = Case(
            "projection", shape, tokens, "decode" if decode else "prefill", len(layers), flops
        )
        case.stock_method = stock_choice(tokens, shape.top_k)

        # Bytes of weights each method reads per layer, for its GB/s.
        weight_bytes = {
            "gather_mm_bf16_sorted": expert_bytes / per_expert * shape.ffn * shape.hidden * 2,
            "dense_qmm": quantized_bytes(shape.ffn, shape.hidden),
            "dense_bf16": shape.ffn * shape.hidden * 2,
        }
        names = projection_methods(tokens, shape.top_k, args)
        for name in names:
            fn = PROJECTION_FUNCTIONS[name]
            try:
                stats = bench(
                    lambda: [fn(x, x_rows, layer) for layer in layers],
                    args.warmup,
                    args.reps,
                    max_seconds=args.max_seconds,
                )
            except RuntimeError as error:
                # MLX's own kernels can fail at large sizes (stock unsorted gather_qmm at
                # T = 8192 on CUDA: "cuGraphAddKernelNode ... invalid argument"): the row
                # shows "-" for that method and the JSON keeps the message.
                case.errors[name] = str(error)
                log(f"[kernels] {shape.name} T={tokens} {name} failed: {error}")
            else:
                case.methods[name] = stats_dict(
                    stats, len(layers), flops, weight_bytes.get(name, expert_bytes)
                )
            progress.step(f"{shape.name} T={tokens} {name}")
        if args.torch != "off" and not decode:
            torch_requests.append(torch_case(case.key, shape, layers[0].indices, args))

        ours = [m for m in ("ours_prefill", "ours_decode") if m in case.methods]
        case.ours_method = ours_choice(tokens, shape.top_k)
        reference_method = "stock_sorted" if "stock_unsorted" in case.errors else "stock_unsorted"
        reference = PROJECTION_FUNCTIONS[reference_method](x, x_rows, layers[0])
        for name in ours + ["stock_sorted"]:
            if name == reference_method or name in case.errors:
                continue
            out = PROJECTION_FUNCTIONS[name](x, x_rows, layers[0])
            case.rel_err[name] = rel_err(out, reference)
        cases.append(case)
    return cases


def build_blocks(shape: Shape, count: int) -> List[SwitchGLU]:
    """Quantized mlx-lm SwitchGLU blocks. nn.quantize swaps in QuantizedSwitchLinear lazily;
    its own random init is never evaluated because random bf16-generated weights replace it."""
    blocks = []
    for _ in range(count):
        block = SwitchGLU(shape.hidden, shape.ffn, shape.experts)
        nn.quantize(block, group_size=GROUP_SIZE, bits=BITS)
        for proj, (out_dims, in_dims) in (
            (block.gate_proj, (shape.ffn, shape.hidden)),
            (block.up_proj, (shape.ffn, shape.hidden)),
            (block.down_proj, (shape.hidden, shape.ffn)),
        ):
            proj.weight, proj.scales, proj.biases = random_quantized(
                shape.experts, out_dims, in_dims
            )
        blocks.append(block)
    return blocks


def run_block_cases(shape: Shape, args, progress: Progress) -> List[Case]:
    per_expert = 3 * quantized_bytes(shape.ffn, shape.hidden)
    count = pool_size(shape, shape.experts * per_expert, args)
    log(f"[kernels] {shape.name}: building {count} SwitchGLU block(s)")
    blocks = build_blocks(shape, count)
    cases = []
    for tokens in args.tokens:
        decode = tokens <= args.chain_max_tokens
        chain = blocks if decode else blocks[: args.prefill_layers]
        routing = [random_routing(tokens, shape.experts, shape.top_k) for _ in chain]
        x = mx.random.normal((tokens, shape.hidden), dtype=mx.bfloat16)
        mx.eval(x, routing)
        flops = 3 * 2.0 * tokens * shape.top_k * shape.hidden * shape.ffn
        expert_bytes = per_expert * np.mean([distinct_experts(r) for r in routing])
        case = Case(
            "switch_glu", shape, tokens, "decode" if decode else "prefill", len(chain), flops
        )
        case.stock_method, case.ours_method = "stock", "patched"

        def run_chain():
            return [block(x, r) for block, r in zip(chain, routing)]

        outputs = {}
        for name, switch in (("stock", mlx_moe_fix.revert), ("patched", mlx_moe_fix.apply)):
            switch()
            take_path_counts()
            stats = bench(run_chain, args.warmup, args.reps, max_seconds=args.max_seconds)
            if name == "patched":
                case.paths = take_path_counts()
            case.methods[name] = stats_dict(stats, len(chain), flops, expert_bytes)
            outputs[name] = chain[0](x, routing[0])
            mx.eval(outputs[name])
            progress.step(f"{shape.name} SwitchGLU T={tokens} {name}")
        mlx_moe_fix.revert()
        case.rel_err["patched"] = rel_err(outputs["patched"], outputs["stock"])
        cases.append(case)
    return cases


def rate(method: Optional[Dict[str, Any]], key: str) -> Optional[float]:
    return method.get(key) if method else None


def micros(method: Optional[Dict[str, Any]]) -> str:
    """Per-layer microseconds with the graph-building part in brackets."""
    if not method:
        return "-"
    return f"{fmt(method['median_s'] * 1e6)} ({fmt(method['build_s'] * 1e6)})"


def other_op(ours_method: str) -> str:
    """The op the dispatcher did not pick, timed for comparison where small enough."""
    return "ours_decode" if ours_method == "ours_prefill" else "ours_prefill"


def err_cell(case: Case) -> str:
    worst = max(case.rel_err.values()) if case.rel_err else None
    flag = " MISMATCH" if worst is not None and worst > REL_ERR_LIMIT else ""
    return (f"{worst:.1e}" if worst is not None else "-") + flag


def tables(cases: List[Case], blocks: List[Case]) -> str:
    out = []
    prefill = [c for c in cases if c.mode == "prefill"]
    if prefill:
        out.append(
            "Expert projection, prefill (TFLOP/s; ours/stock = stock time / ours time; "
            "stock = SwitchGLU's choice)"
        )
        rows = []
        for c in prefill:
            m = c.methods
            rows.append(
                [
                    c.shape.name,
                    c.tokens,
                    fmt(rate(m.get("stock_unsorted"), "tflops")),
                    fmt(rate(m.get("stock_sorted"), "tflops")),
                    fmt(rate(m.get(c.ours_method), "tflops")),
                    fmt(rate(m.get(other_op(c.ours_method)), "tflops")),
                    fmt(c.ratio()),
                    fmt(rate(m.get("gather_mm_bf16_sorted"), "tflops")),
                    fmt(rate(m.get("dense_qmm"), "tflops")),
                    fmt(rate(m.get("dense_bf16"), "tflops")),
                    fmt(rate(m.get("torch_grouped_mm_bf16"), "tflops")),
                    err_cell(c),
                ]
            )
        out.append(
            markdown_table(
                [
                    "shape",
                    "T",
                    "stock unsorted",
                    "stock sorted",
                    "ours",
                    "other op",
                    "ours/stock",
                    "gather_mm bf16",
                    "dense qmm",
                    "dense bf16",
                    "torch grouped",
                    "rel err",
                ],
                rows,
            )
        )
    decode = [c for c in cases if c.mode == "decode"]
    if decode:
        out.append(
            "\nExpert projection, decode (us per layer, in brackets the Python graph building "
            "within it; GB/s of expert weights read over the rest, the device part; "
            "ours/stock = stock time / ours time)"
        )
        rows = []
        for c in decode:
            stock, ours = c.methods[c.stock_method], c.methods[c.ours_method]
            rows.append(
                [
                    c.shape.name,
                    c.tokens,
                    c.layers,
                    micros(stock),
                    micros(ours),
                    micros(c.methods.get(other_op(c.ours_method))),
                    fmt(c.ratio()),
                    fmt(stock.get("gbps")),
                    fmt(ours.get("gbps")),
                    fmt(c.methods["dense_qmm"]["median_s"] * 1e6),
                    err_cell(c),
                ]
            )
        out.append(
            markdown_table(
                [
                    "shape",
                    "T",
                    "layers",
                    "stock us",
                    "ours us",
                    "other op us",
                    "ours/stock",
                    "stock GB/s",
                    "ours GB/s",
                    "dense qmm us",
                    "rel err",
                ],
                rows,
            )
        )
    if blocks:
        out.append(
            "\nWhole SwitchGLU (gate/up/down), stock vs mlx_moe_fix.apply() "
            "(ms per layer; TFLOP/s for prefill, GB/s for decode)"
        )
        rows = []
        for c in blocks:
            key = "tflops" if c.mode == "prefill" else "gbps"
            stock, patched = c.methods["stock"], c.methods["patched"]
            rows.append(
                [
                    c.shape.name,
                    c.tokens,
                    c.mode,
                    fmt(stock["median_s"] * 1e3),
                    fmt(patched["median_s"] * 1e3),
                    fmt(c.ratio()),
                    f"{fmt(stock.get(key))} -> {fmt(patched.get(key))} {key}",
                    err_cell(c),
                ]
            )
        out.append(
            markdown_table(
                ["shape", "T", "mode", "stock ms", "patched ms", "speedup", "rate", "rel err"],
                rows,
            )
        )
    return "\n".join(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--shapes",
        default=",".join(SHAPES),
        help=f"comma-separated, from {', '.join(SHAPES)} (default: all)",
    )
    p.add_argument(
        "--tokens",
        default=",".join(map(str, DEFAULT_TOKENS)),
        help="comma-separated token counts T (default: %(default)s)",
    )
    p.add_argument("--warmup", type=int, default=3, help="warm-up calls per case")
    p.add_argument("--reps", type=int, default=20, help="timed calls per case (at most)")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=2.0,
        help="time budget per method and case; slow stock cases run fewer reps (min 3)",
    )
    p.add_argument(
        "--chain-max-tokens",
        type=int,
        default=16,
        help="T up to this is timed as decode: --layers independent layers in one graph",
    )
    p.add_argument("--layers", type=int, default=32, help="layers chained for decode rows")
    p.add_argument(
        "--prefill-layers",
        type=int,
        default=4,
        help="independent layers per timed graph for prefill rows: one eval round trip per call "
        "is a large share of a sub-millisecond kernel (1: one layer per call, as before)",
    )
    p.add_argument(
        "--pool-gb",
        type=float,
        default=32.0,
        help="cap on the weights of the chained layers (DeepSeek-V3 experts are 2.1 GB a "
        "projection, so it chains fewer)",
    )
    p.add_argument(
        "--decode-max-pairs",
        type=int,
        default=128,
        help="also time moe_decode where T * top_k is at most this",
    )
    p.add_argument("--no-block", action="store_true", help="skip the SwitchGLU rows")
    p.add_argument("--no-bf16-gather", action="store_true", help="skip the gather_mm bf16 column")
    p.add_argument(
        "--torch",
        choices=["auto", "off"],
        default="auto",
        help="torch._grouped_mm column, timed in a child process, where torch with CUDA "
        "imports there (default: auto)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds weights, inputs and routing")
    p.add_argument("--json", help="write all numbers here")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shape, T = 1, 4, 64, 2 chained layers, few reps: checks the script runs",
    )
    args = p.parse_args(argv)
    if mx.default_device() == mx.cpu:
        args.no_bf16_gather = True  # MLX's CPU gather_mm runs float32 only
    if args.smoke:
        args.shapes_list = list(SMOKE_SHAPES.values())
        args.tokens = [1, 4, 64]
        args.chain_max_tokens, args.layers, args.prefill_layers = 4, 2, 2
        args.warmup, args.reps = 1, 2
    else:
        unknown = set(args.shapes.split(",")) - set(SHAPES)
        if unknown:
            p.error(f"unknown shapes {sorted(unknown)}; choose from {list(SHAPES)}")
        args.shapes_list = [SHAPES[s] for s in args.shapes.split(",")]
        args.tokens = [int(t) for t in args.tokens.split(",")]
    return args


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    mx.random.seed(args.seed)
    env = environment()
    log("[kernels] " + environment_line(env))
    mlx_moe_fix.revert()  # the stock columns must see stock MLX

    steps = 0
    for shape in args.shapes_list:
        for tokens in args.tokens:
            steps += len(projection_methods(tokens, shape.top_k, args))
            steps += 0 if args.no_block else 2
    progress = Progress(steps, "kernels")
    result = {
        "env": env,
        "mlx_moe_fix_status": mlx_moe_fix.status(),
        "config": {k: v for k, v in vars(args).items() if k != "shapes_list"},
        "results": [],
        "blocks": [],
    }
    cases, blocks, torch_requests = [], [], []
    for shape in args.shapes_list:
        # Each call's weights are gone once it returns: hand their memory back before the
        # next one allocates (DeepSeek-V3's chained layers take tens of GB).
        cases += run_projection_cases(shape, args, torch_requests, progress)
        mx.clear_cache()
        if not args.no_block:
            blocks += run_block_cases(shape, args, progress)
            mx.clear_cache()
        result["results"] = [c.to_dict() for c in cases]
        result["blocks"] = [c.to_dict() for c in blocks]
        if args.json:  # after every shape, so a run cut short still leaves its numbers
            write_json(args.json, result)
    if torch_requests:
        # Last, in a process of its own, once MLX's buffers are back: torch's CUDA libraries
        # never share a process with MLX's.
        log(f"[kernels] torch._grouped_mm column: {len(torch_requests)} case(s)")
        torch_results = run_torch_cases(torch_requests)
        env["torch"] = torch_results.get("torch") or torch_results.get("error")
        for case in cases:
            timing = torch_results.get("results", {}).get(case.key)
            if timing and "median_s" in timing:
                timing["tflops"] = case.flops / timing["median_s"] / 1e12
            if timing:
                case.methods["torch_grouped_mm_bf16"] = timing
        result["results"] = [c.to_dict() for c in cases]
        if args.json:
            write_json(args.json, result)
    if args.json:
        log(f"[kernels] wrote {args.json}")
    print(f"# Expert matmul kernels: {environment_line(env)}\n")
    print(tables(cases, blocks))
    return result


if __name__ == "__main__":
    main()
