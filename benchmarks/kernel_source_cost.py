"""Host time of a `mx.fast.cuda_kernel` launch by the size of its source. MLX copies a kernel's
whole source into each call's primitive and hashes it (std::hash) at every evaluation
(mlx/backend/cuda/custom_kernel.cpp), so every KB of header costs each launch of a decode step.

    python3 -m benchmarks.kernel_source_cost                 # 48 launches per chain, 0-32 KB
    python3 -m benchmarks.kernel_source_cost --kb 0,8,16

A chain of --launches dependent launches of a one-line kernel (each step's input the previous
step's output, as a decode step's layers are), its header padded with a comment of N KB; µs per
launch, build (the Python calls that make the lazy graph) and eval (mx.eval: MLX's eval_gpu per
node, then the GPU), medians of --reps after 5 warm-ups; a chain of mx.add for scale. Last: what
the package's own kernels weigh (cuda_kernel_source: header and body as compiled, against their
file's whole header)."""

import argparse

import mlx.core as mx

from mlx_moe_fix.kernels.sources import cuda_kernel_source, sections

from .decode_split import split
from .timing import markdown_table

# (file, section) of every CUDA kernel the ops launch
KERNELS = (("moe_decode.cu", "gate_up"), ("moe_decode.cu", "down"), ("moe_decode.cu", "routed_down"),
           ("moe_decode.cu", "shared_gate_up"), ("moe_decode.cu", "shared_down"),
           ("moe_routed_decode.cu", "routed_gate_up"), ("moe_router.cu", "topk"), ("moe_router.cu", "sigmoid_topk"),
           ("moe_prefill.cu", "grouped"), ("moe_prefill.cu", "grouped_wgmma"), ("moe_prefill.cu", "route"),
           ("moe_prefill.cu", "combine"))


def chain_times(step, x: mx.array, launches: int, reps: int) -> tuple:
    """Median µs per launch (build, eval) of `launches` dependent calls of step."""
    def chain():
        y = x
        for _ in range(launches):
            y = step(y)
        return y

    return tuple(seconds / launches * 1e6 for seconds in split(chain, reps, warm_ups=5))


def source_sizes() -> list:
    rows = []
    for filename, section in KERNELS:
        header, body = cuda_kernel_source(filename, section)
        whole = sections("cuda", filename)
        rows.append([f"{filename} {section}", f"{(len(header) + len(body)) / 1024:.1f}",
                     f"{(len(whole['header']) + len(whole[section])) / 1024:.1f}"])
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kb", default="0,4,8,16,32", help="header paddings, KB, comma-separated")
    parser.add_argument("--launches", type=int, default=48)
    parser.add_argument("--reps", type=int, default=60)
    args = parser.parse_args(argv)
    if not mx.cuda.is_available():
        raise SystemExit("kernel_source_cost times mx.fast.cuda_kernel launches: run it on a CUDA GPU")

    x = mx.zeros((256,), mx.float32)
    mx.eval(x)
    rows = []
    for kb in (int(n) for n in args.kb.split(",")):
        kernel = mx.fast.cuda_kernel(
            name=f"mlx_moe_fix_source_cost_{kb}kb", input_names=["a"], output_names=["out"],
            source="int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < 256) out[i] = a[i] + 1.f;",
            header="// " + "x" * (kb * 1024) + "\n")

        def step(y, kernel=kernel):
            return kernel(inputs=[y], grid=(256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(256,)],
                          output_dtypes=[mx.float32])[0]

        rows.append([f"cuda_kernel, {kb} KB of header", *(f"{t:.2f}" for t in chain_times(step, x, args.launches, args.reps))])
    rows.append(["mx.add (for scale)", *(f"{t:.2f}" for t in chain_times(lambda y: y + 1, x, args.launches, args.reps))])
    print(f"{args.launches} dependent launches, µs per launch, medians of {args.reps}; MLX {mx.__version__}, {mx.default_device()}")
    print(markdown_table(["launch", "build", "eval"], rows))
    print("\nThe package's kernels, KB of source: as compiled (cuda_kernel_source) / with their file's whole header")
    print(markdown_table(["kernel", "as compiled", "whole header"], source_sizes()))


if __name__ == "__main__":
    main()
