"""What the GPU itself does during MLX's decode work: every kernel's time on the device, traced
by CUPTI through torch.profiler (it records the kernels of the whole process, MLX's graph-launched
ones included), beside the host's build and evaluation of the same work. Needs torch with CUDA
(the GPU machine has it); MLX's own timers cannot tell a kernel's time from the gaps between.

    python3 -m benchmarks.gpu_timeline                                # decode blocks, then qwen3_moe's token
    python3 -m benchmarks.gpu_timeline --parts blocks --shapes qwen3  # one shape's blocks only
    python3 -m benchmarks.gpu_timeline --parts tokens --model inkling --deepseek-layers 6
    python3 -m benchmarks.gpu_timeline --parts tokens --batch 4      # a decode step of 4 sequences
    python3 -m benchmarks.gpu_timeline --parts blocks --shapes qwen3 --block-shapes gate_up=4x2x24
                                       # production's block shapes, then these (benchmarks/block_shapes.py)
    python3 -m benchmarks.gpu_timeline --parts blocks --routers   # also with each layer's quantized router
    python3 -m benchmarks.gpu_timeline --parts prefill --cases qwen3:2048,mixtral:2048 --launches 8

The host's build and evaluation are timed while traced, and CUPTI adds host time to each launch:
they are upper bounds, and busy / evaluation a lower bound of the GPU's busy share (benchmarks.
decode_timeline times the host untraced). A kernel's own time includes any kernel of an independent
graph node that ran beside it; the GPU's busy time counts such overlaps once.

blocks: --layers routed decode blocks (moe_routed_decode, 4-bit g64, bf16 random SwitchGLU layers,
as benchmarks.decode_ab builds them) per shape, each layer's output the next one's input, as in a
model; per layer: the host's build and evaluation (µs), the kernels' summed device time, and the
routed experts' bytes over the GPU's busy time (issue 5's bandwidth, on the kernels' own time).
The blocks take each layer's router logits as given; with --routers, two more rows per shape take
each layer's quantized router (8-bit at Qwen3's shape, as mlx-lm quantizes qwen3_moe's `mlp.gate`;
4-bit at Mixtral's), its matmul as a node of its own ("router node", MLX_MOE_FIX_CUDA_FUSED_ROUTER=0)
or inside the gate+up launch ("router inside"), so that the router's device time counts.
tokens: one decode token of --model (of --batch sequences at once), patched, and of its dense
equivalent (mlx-lm's generate_step loop, benchmarks.decode_timeline.Decoder): the token's build and evaluation against
the kernels' device time (where the device time is well under the token's, the token is host time).
prefill: the CUDA prefill op's gate+up launch, down launch and whole layer (benchmarks.prefill_ab's
cases and calls), --launches a traced graph, side by side and in sequence (prefill_part): the
evaluation's wall time against the kernels' busy time, as TFLOP/s (issue 4's rates on the kernels'
own time, which is how torch._grouped_mm's are timed in benchmarks.kernels: CUDA events), and
against the summed time of this package's kernels alone (own_kernel_time): in sequence that leaves
out the passes that chain the launches (docs/benchmarks.md, seventy-fourth stop: there the GEMMs
ran as fast as side by side, and the busy time's gap was those passes and the idle time between).
Per part the kernels are also listed by name (the longest summed time first: count a layer or token, mean
µs), the first --top-kernels of them (0: all).
"""

import argparse
import collections
import json
import os
import statistics
import tempfile

import mlx.core as mx

from mlx_moe_fix.kernels.kernel_cache import OUR_KERNEL_PREFIX

from .timing import build_and_evaluation, in_sequence, markdown_table, repeated, warm_up

TOP_KERNELS = 6  # kernels listed a part, the longest summed time first (--top-kernels)


def kernel_events(trace: dict) -> list:
    """The kernel events of a Chrome trace (torch.profiler's export), by start time."""
    return sorted((e for e in trace["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def busy_time(kernels: list) -> float:
    """The time (µs) at least one of `kernels` (by start time) runs: kernels of independent graph
    nodes run at once, and their summed times count the overlap twice."""
    busy, end = 0.0, float("-inf")
    for k in kernels:
        start, stop = k["ts"], k["ts"] + k["dur"]
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy


def own_kernel_time(kernels: list) -> float:
    """The summed time (µs) of this package's kernels among `kernels`: in sequence, the op's own
    time without the benchmark's dependency passes (MLX's kernels); side by side, launches that
    overlap share the GPU and each counts its whole span, so the rate on it reads low there."""
    return sum(k["dur"] for k in kernels if OUR_KERNEL_PREFIX in k["name"])


def kernel_table(kernels: list, per: int) -> list:
    """[(name, count per `per`, mean µs)] of `kernels` (trace events), the most summed time first."""
    by_name = collections.defaultdict(list)
    for k in kernels:
        by_name[k["name"]].append(k["dur"])
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))
    return [(name, len(durations) / per, statistics.mean(durations)) for name, durations in ranked]


def traced(fn, reps: int) -> tuple:
    """([(build s, evaluation s)] per rep, kernel events of all reps) of `fn` (builds and returns
    arrays), after 3 untraced warm-up calls at the same shapes."""
    from torch.profiler import ProfilerActivity, profile

    warm_up(fn)
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        phases = [build_and_evaluation(fn) for _ in range(reps)]
    return phases, kernel_events(exported_trace(profiler))


def exported_trace(profiler) -> dict:
    """The Chrome trace of a finished torch.profiler run."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)


def summary(label: str, phases: list, kernels: list, reps: int, per: int, nbytes=None) -> tuple:
    """(the table row, the kernels' lines, every kernel's, the longest summed time first) of one
    traced part, per layer or token (`per` of them a rep)."""
    build, evaluation = (statistics.median(p[i] for p in phases) * 1e6 / per for i in range(2))
    summed = sum(k["dur"] for k in kernels) / reps / per
    busy = busy_time(kernels) / reps / per
    row = [label, f"{build:.1f}", f"{evaluation:.1f}", f"{len(kernels) / reps / per:.1f}", f"{summed:.1f}", f"{busy:.1f}",
           f"{busy / evaluation:.2f}", "-" if nbytes is None else f"{nbytes / busy / 1e3:.0f}"]
    lines = [f"  {label}: {count:.1f} x {mean:.2f} µs  {name[:100]}" for name, count, mean in kernel_table(kernels, reps * per)]
    return row, lines


ROUTER_QUANTIZATION = {"qwen3": (8, 64), "mixtral": (4, 64)}  # (bits, group) as mlx-lm quantizes the models' routers


def router_rows(shape: str, built: list, routing, reps: int, nbytes: float) -> list:
    """The chained blocks with a quantized router a layer: its matmul a node of its own, then
    inside the gate+up launch."""
    import mlx.nn as nn

    from mlx_moe_fix.kernels import RouterLinear
    from mlx_moe_fix.kernels.moe_routed_decode import FUSED_ROUTER_SWITCH, moe_routed_decode_kernel

    from .decode_split import switched
    from .prefill_ab import SHAPES
    from .switch_glu import experts_of

    hidden, _, count, _ = SHAPES[shape]
    bits, group = ROUTER_QUANTIZATION[shape]
    routers = []
    for _ in built:
        linear = nn.Linear(hidden, count, bias=False)
        linear.weight = mx.random.normal(linear.weight.shape) * 0.02
        linear.set_dtype(mx.bfloat16)
        routers.append(RouterLinear.from_module(nn.QuantizedLinear.from_linear(linear, group_size=group, bits=bits)))
    mx.eval([(r.weight, r.scales, r.biases) for r in routers])
    experts = [experts_of(layer) for layer in built]
    x0 = (mx.random.normal((1, hidden)) * 0.5).astype(mx.bfloat16)
    mx.eval(x0)

    def chained():
        x, outputs = x0, []
        for router, e in zip(routers, experts):
            x = moe_routed_decode_kernel(x, router, routing, e)
            outputs.append(x)
        return outputs

    rows = []
    for label, value in (("router node", "0"), ("router inside", "1")):
        with switched(FUSED_ROUTER_SWITCH, value):
            phases, kernels = traced(chained, reps)
        rows.append(summary(f"{shape}, a layer [{label}, {bits}-bit router]", phases, kernels, reps, len(built), nbytes))
    return rows


def blocks_part(shapes: list, layers: int, reps: int, bits: int = 4, variants: tuple = ({},), routers: bool = False) -> list:
    """Per shape, the chained routed decode blocks at each of `variants` (benchmarks/block_shapes.py's
    {constant: BlockShape}, {} for production's), the layers built once; each variant's first
    layer is checked against the fp32 reference (the error in its label); with `routers`,
    router_rows' two rows."""
    from mlx_moe_fix import kernels as this_tree
    from mlx_moe_fix.kernels.moe_routed_decode import moe_routed_decode_kernel, moe_routed_decode_reference

    from . import block_shapes
    from .decode_ab import routed_layers
    from .prefill_ab import SHAPES
    from .switch_glu import experts_of

    results = []
    for shape in shapes:
        built, logits, routing, nbytes = routed_layers(shape, layers, this_tree, bits)
        x0 = (mx.random.normal((1, SHAPES[shape][0])) * 0.5).astype(mx.bfloat16)
        mx.eval(x0)
        for variant in variants:
            with block_shapes.block_shapes(variant):
                experts = [experts_of(layer) for layer in built]  # fresh launch plans
                first = moe_routed_decode_kernel(x0, logits[0], routing, experts[0]).astype(mx.float32)
                expected = moe_routed_decode_reference(x0.astype(mx.float32), logits[0].astype(mx.float32), routing, experts[0])
                error = (mx.abs(first - expected).max() / mx.abs(expected).max()).item()

                def chained(experts=experts):
                    x, outputs = x0, []
                    for lg, e in zip(logits, experts):
                        x = moe_routed_decode_kernel(x, lg, routing, e)
                        outputs.append(x)
                    return outputs

                phases, kernels = traced(chained, reps)
            label = f"{shape}, a layer" + ("" if not variant else f" [{block_shapes.label(variant)}; max rel. error {error:.1e}]")
            results.append(summary(label, phases, kernels, reps, layers, nbytes))
        if routers:
            results += router_rows(shape, built, routing, reps, nbytes)
    return results


def tokens_part(args, reps: int) -> list:
    from . import models
    from .decode_timeline import Decoder, prompts_of

    spec, built, prompt = models.build_decode_pair(args)
    prompts = prompts_of(prompt, args.batch, spec.config["vocab_size"])
    step = "a token" if args.batch == 1 else f"a step of batch {args.batch}"
    results = []
    for label, dense, mode in ((f"{args.model} patched, {step}", False, "patched"),
                               (f"dense equivalent, {step}", True, "stock")):
        models.set_mode(mode)
        decoder = Decoder(built[dense], prompts)
        decoder.burst(4)  # compiled steps traced at exactly these shapes

        def token(decoder=decoder):
            decoder.y, decoder.logprobs = decoder.step(decoder.y)
            return [decoder.y, decoder.logprobs]

        phases, kernels = traced(token, reps)
        results.append(summary(label, phases, kernels, reps, 1))
    models.set_mode("stock")
    return results


def prefill_part(cases: list, launches: int, reps: int, top_kernels: int = TOP_KERNELS) -> tuple:
    """Per case (shape:tokens, benchmarks.prefill_ab's), part (gate_up, down, layer: prefill_ab's
    calls) and order (ORDERS), `launches` launches a traced graph: (table rows, the first
    `top_kernels` kernel lines of each, 0: all). The rows set the part's useful FLOPs over the
    evaluation's wall time (what prefill_ab reports, the build left out) beside the same FLOPs over
    the GPU's busy time, so that time spent outside the kernels shows as their gap."""
    import importlib

    from .prefill_ab import PARTS, build_case, part_calls, part_flops
    from .switch_glu import experts_of

    package = importlib.import_module("mlx_moe_fix.kernels")
    prefill = importlib.import_module("mlx_moe_fix.kernels.moe_prefill")
    rows, lines = [], []
    for case in cases:
        shape, tokens = case.split(":")
        layer, x, indices, weights = build_case(shape, int(tokens))
        calls = part_calls(prefill, experts_of(layer, package), x, indices, weights)
        for part in PARTS:
            flops = part_flops(part, shape, indices.size) * launches
            for order, graph in ORDERS.items():
                phases, kernels = traced(graph(calls[part][0], launches), reps)
                evaluation = statistics.median(p[1] for p in phases)
                busy = busy_time(kernels) / reps * 1e-6
                own = own_kernel_time(kernels) / reps * 1e-6
                label = f"{case} {part}, {order}"
                rows.append([label, str(launches), f"{evaluation * 1e6 / launches:.1f}", f"{busy * 1e6 / launches:.1f}",
                             f"{len(kernels) / reps / launches:.1f}", f"{flops / evaluation / 1e12:.1f}",
                             f"{flops / busy / 1e12:.1f}", f"{flops / own / 1e12:.1f}" if own else "-"])
                lines += summary(label, phases, kernels, reps, launches)[1][:top_kernels or None]
                print(markdown_table(PREFILL_COLUMNS, rows[-1:]), flush=True)
    return rows, lines


# How a traced prefill graph holds its launches: independent (benchmarks.prefill_ab's timing; the
# GPU may overlap one launch's tail with the next one's start) or each after the previous one's
# output, as a model's layers run.
ORDERS = {"side by side": repeated, "in sequence": in_sequence}
PREFILL_COLUMNS = ["case, part, order", "launches a graph", "evaluation µs a launch", "GPU busy µs a launch",
                   "kernels a launch", "TF/s on evaluation", "TF/s on busy time", "TF/s on our kernels' summed time"]


def main(argv=None):
    from . import block_shapes, models
    from .decode_timeline import add_batch_argument

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="blocks,tokens", help="blocks, tokens and / or prefill")
    parser.add_argument("--cases", default="qwen3:2048,mixtral:2048", help="prefill: shape:tokens,... (benchmarks.prefill_ab's)")
    parser.add_argument("--launches", type=int, default=4, help="prefill: launches a traced graph (prefill_ab's --launches)")
    parser.add_argument("--shapes", default="qwen3,mixtral")
    parser.add_argument("--layers", type=int, default=16, help="chained decode blocks a traced graph holds")
    parser.add_argument("--reps", type=int, default=5, help="traced calls a part")
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8), help="the blocks' experts' quantization bits")
    parser.add_argument("--block-shapes", action="append", default=[], metavar="STAGE=WxRxN,...",
                        help="blocks: one more variant with these decode block shapes (benchmarks/block_shapes.py; repeatable)")
    parser.add_argument("--routers", action="store_true", help="blocks: also with a quantized router a layer (node / inside)")
    parser.add_argument("--top-kernels", type=int, default=TOP_KERNELS, help="kernels listed a part (0: all of them)")
    models.add_decode_pair_arguments(parser)
    add_batch_argument(parser)
    args = parser.parse_args(argv)
    args.smoke = False
    if not mx.cuda.is_available():
        raise SystemExit("gpu_timeline traces CUDA kernels: run it on a CUDA GPU")
    try:
        import torch
    except ImportError:
        raise SystemExit("gpu_timeline traces the kernels with torch.profiler: install torch with CUDA")
    torch.zeros(1, device="cuda")  # CUDA and CUPTI up before the first trace
    results = []
    parts = args.parts.split(",")
    if "blocks" in parts:
        variants = ({},) + tuple(block_shapes.parse(text) for text in args.block_shapes)
        results += blocks_part(args.shapes.split(","), args.layers, args.reps, args.bits, variants, args.routers)
    if "tokens" in parts:
        results += tokens_part(args, args.reps)
    if "prefill" in parts:
        prefill_rows, prefill_lines = prefill_part(args.cases.split(","), args.launches, args.reps, args.top_kernels)
        print("\n".join(prefill_lines))
        print(markdown_table(PREFILL_COLUMNS, prefill_rows))
        if not results:
            return
    print(f"MLX {mx.__version__}, {mx.default_device()}; medians of {args.reps} traced calls; µs a layer or token")
    for _, lines in results:
        print("\n".join(lines[:args.top_kernels or None]))
    print(markdown_table(["part", "build", "evaluation", "kernels", "kernels' summed time", "GPU busy", "busy / evaluation",
                          "GB/s on the busy time"], [row for row, _ in results]))


if __name__ == "__main__":
    main()
