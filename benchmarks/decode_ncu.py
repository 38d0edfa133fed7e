"""The decode kernels alone at one expert shape, for ncu, and the table of ncu's readings.

    ncu --clock-control none --print-units base --kernel-name regex:"custom|all_reduce|qmv" \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__registers_per_thread,\\
sm__warps_active.avg.pct_of_peak_sustained_active --csv \\
        python3 -m benchmarks.decode_ncu --shape qwen3 --variants routed,unrouted,routed:rows=2 > ncu.csv
    python3 -m benchmarks.decode_ncu --table ncu.csv        # median µs per kernel, TB/s, registers
    python3 -m benchmarks.decode_ncu --smoke                # tiny shape, CPU (the references)

One quantized mlx-lm SwitchGLU at Qwen3-30B-A3B's expert shape (2048 -> 768, 128 experts, top-8,
softmax then top-k) or Mixtral-8x7B's (4096 -> 14336, 8 experts, top-2, top-k then softmax), 4-bit
g64 bf16, one token. Each variant makes --calls decode calls: `routed` (moe_routed_decode: the
routing inside the gate+up launch) or `unrouted` (moe_router's launch, then moe_decode's two),
with optional `:rows=R` and `:warps=W` (the rows a warp and warps a block of moe_decode's
GATE_UP_BLOCK and DOWN_BLOCK), `:resident=N` (every decode launch bounded to N warps an SM) and
`:shapes=STAGE=WxRxN+...` (benchmarks/block_shapes.py, `+` for its commas), set on moe_decode
before a fresh launch plan; its last
output is checked against the fp32 reference. Then, as yardsticks over the gate+up's bytes, an
MLX sum (a plain read) and MLX's dense quantized GEMV over as many rows. ncu flushes the caches
before each kernel; the table leaves each kernel's first call out and keys kernels by name
(source digest and template arguments included), launch bounds and grid."""

import argparse
import csv
import io
import re
import statistics
from types import SimpleNamespace

import mlx.core as mx

from mlx_moe_fix.kernels import Routing, moe_router
from mlx_moe_fix.kernels.moe_routed_decode import moe_routed_decode, moe_routed_decode_reference

from . import block_shapes
from .switch_glu import experts_of, quantized_switch_glu

decode_module = block_shapes.decode_module

SHAPES = {
    "qwen3": (SimpleNamespace(hidden=2048, ffn=768, experts=128, top_k=8), Routing("softmax_topk", 8, normalize=True)),
    "mixtral": (SimpleNamespace(hidden=4096, ffn=14336, experts=8, top_k=2), Routing("topk_softmax", 2)),
    "smoke": (SimpleNamespace(hidden=128, ffn=64, experts=8, top_k=2), Routing("softmax_topk", 2, normalize=True)),
}
KNOBS = ("rows", "warps", "resident", "shapes")


def parse_variant(text: str) -> tuple:
    """'routed:rows=2:warps=8' -> ('routed', {'rows': 2, 'warps': 8})."""
    kind, *settings = text.split(":")
    if kind not in ("routed", "unrouted"):
        raise ValueError(f"unknown variant kind {kind!r} (routed or unrouted)")
    knobs = {}
    for setting in settings:
        name, _, value = setting.partition("=")
        if name == "shapes":
            knobs[name] = block_shapes.parse(value.replace("+", ","))
        elif name in KNOBS and value.isdigit():
            knobs[name] = int(value)
        else:
            raise ValueError(f"unknown setting {setting!r} (rows=, warps=, resident=, shapes=)")
    return kind, knobs


def shapes_of(knobs: dict) -> dict:
    """The block shapes (block_shapes' {constant: BlockShape}) a variant's knobs set: rows=, warps=
    and resident= as block_shapes.varied takes them, then shapes=."""
    return {**block_shapes.varied(knobs.get("rows"), knobs.get("warps"), knobs.get("resident")), **knobs.get("shapes", {})}


def run_variant(layer, x, logits, routing: Routing, kind: str, knobs: dict, calls: int) -> float:
    """`calls` decode calls of one variant; the last output's max |error| against the float32
    reference of the same routing."""
    with block_shapes.block_shapes(shapes_of(knobs)):
        experts = experts_of(layer)  # a fresh memo of launch plans
        for _ in range(calls):
            if kind == "routed":
                y = moe_routed_decode(x, logits, routing, experts)
            else:
                indices, weights = moe_router(logits, routing)
                y = decode_module.moe_decode(x, indices, experts, weights)
            mx.eval(y)
    # routed from the logits as the kernels get them: in float32 two logits a bf16 softmax ties may
    # rank the other way (1 call in ~300 chose another expert), and the check is of the experts' sums
    expected = moe_routed_decode_reference(x.astype(mx.float32), logits, routing, experts)
    return mx.abs(y.astype(mx.float32) - expected).max().item()


def run(shape: str, variants: list, calls: int) -> None:
    args, routing = SHAPES[shape]
    layer = quantized_switch_glu(args)
    x = mx.random.normal((1, args.hidden)).astype(mx.bfloat16)
    logits = mx.random.normal((1, args.experts)).astype(mx.bfloat16)
    mx.eval(x, logits)
    for text in variants:
        kind, knobs = parse_variant(text)
        error = run_variant(layer, x, logits, routing, kind, knobs, calls)
        print(f"check {shape} {text}: max |kernel - fp32 reference| {error:.3g}", flush=True)
    gate_up_bytes = sum(layer[n].weight.nbytes + layer[n].scales.nbytes + layer[n].biases.nbytes
                        for n in ("gate_proj", "up_proj")) * args.top_k // args.experts
    plain = mx.zeros((gate_up_bytes // 4,), mx.uint32)
    dense = mx.quantize(mx.random.normal((2 * args.ffn * args.top_k, args.hidden)).astype(mx.bfloat16), group_size=64, bits=4)
    mx.eval(plain, dense)
    for _ in range(calls):
        mx.eval(mx.sum(plain))
        mx.eval(mx.quantized_matmul(x, *dense, transpose=True, group_size=64, bits=4))
    print(f"done {shape}: the gate+up reads {gate_up_bytes} bytes", flush=True)


def kernel_label(name: str) -> str:
    """A kernel's label in the table: ours by op, launch bounds, source digest and template
    arguments; MLX's by the tail of its name."""
    base = name.split("(")[0]
    ours = re.search(r"moe_fix_(\w+?)_smem0(\w*?)_([0-9a-f]{12})_(\w*)", base)
    return f"{ours.group(1)}{ours.group(2)} {ours.group(3)[:4]} {ours.group(4)}" if ours else base[-48:]


def table(text: str) -> list:
    """ncu's --csv output -> rows (label, grid, median µs, TB/s, registers, % of warps active,
    calls counted), kernels in order of first appearance."""
    lines = [line for line in text.splitlines(keepends=True) if line.startswith('"')]
    lines = lines[:1] + [line for line in lines[1:] if not line.startswith('"ID"')]
    readings = {}
    for row in csv.DictReader(io.StringIO("".join(lines))):
        key = (kernel_label(row["Kernel Name"]), row["Grid Size"] + row["Block Size"])
        readings.setdefault(key, {}).setdefault(row["Metric Name"], []).append(float(row["Metric Value"].replace(",", "")))
    rows = []
    for (label, grid), metrics in readings.items():
        times = metrics.get("gpu__time_duration.sum", [])
        if not times:
            continue
        counted = times[1:] or times
        us = statistics.median(counted) / 1000
        read = metrics.get("dram__bytes_read.sum", [0.0])[-1]
        rows.append((label, grid, us, read / us / 1e6, metrics.get("launch__registers_per_thread", [0.0])[-1],
                     metrics.get("sm__warps_active.avg.pct_of_peak_sustained_active", [0.0])[-1], len(counted)))
    return rows


def print_table(rows: list) -> None:
    print("| kernel | grid, block | µs | TB/s | registers | warps active % | calls |\n|---|---|---|---|---|---|---|")
    for label, grid, us, tbs, registers, active, calls in rows:
        print(f"| {label} | {grid} | {us:.2f} | {tbs:.2f} | {registers:.0f} | {active:.1f} | {calls} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3")
    parser.add_argument("--variants", default="routed,unrouted", help="comma-separated: routed|unrouted[:rows=R][:warps=W][:resident=N]")
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--table", metavar="CSV", help="print the table of an ncu --csv log instead of running")
    parser.add_argument("--smoke", action="store_true", help="the smoke shape, 2 calls (CPU: the references)")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table) as log:
            print_table(table(log.read()))
        return
    if args.smoke:
        args.shape, args.calls = "smoke", 2
    run(args.shape, args.variants.split(","), args.calls)


if __name__ == "__main__":
    main()
