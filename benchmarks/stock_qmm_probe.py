"""MLX's own quantized matmuls on this device against the same op on the CPU stream, and against
themselves run to run: the probe that found stock `mx.quantized_matmul` wrong on CUDA for 64-wide
inputs (one quantization group per row) at more than one row (docs/benchmarks.md, seventh
session), which is why no zoo projection takes a 64-wide input.

    python3 -m benchmarks.stock_qmm_probe

4-bit, group size 64, bf16; relative errors (the ~1e-2 between devices is bf16 rounding in
another order; NaN where the device's output is not finite).
"""

import mlx.core as mx

from .timing import markdown_table

SHAPES = [(1, 64, 128), (2, 64, 128), (5, 64, 128), (70, 64, 128), (5, 128, 128), (70, 128, 128),
          (5, 192, 128), (70, 256, 128)]
EXPERTS = 4


def relative_error(out: mx.array, ref: mx.array) -> float:
    out, ref = out.astype(mx.float32), ref.astype(mx.float32)
    if not mx.isfinite(out).all().item():
        return float("nan")
    return (mx.linalg.norm(out - ref) / mx.linalg.norm(ref)).item()


def probe(op: str, rows: int, width: int, out_dims: int) -> dict:
    weights = (mx.random.normal((EXPERTS, out_dims, width), key=mx.random.key(width + out_dims)) * 0.05).astype(mx.bfloat16)
    x = mx.random.normal((rows, 1, width), key=mx.random.key(rows)).astype(mx.bfloat16)
    indices = (mx.arange(rows) % EXPERTS).astype(mx.uint32).reshape(rows, 1)
    wq, scales, biases = mx.quantize(weights, group_size=64, bits=4)

    def run():
        if op == "quantized_matmul":
            return mx.quantized_matmul(x.reshape(rows, width), wq[0], scales[0], biases[0], transpose=True,
                                       group_size=64, bits=4)
        return mx.gather_qmm(x, wq, scales, biases, rhs_indices=indices, transpose=True, group_size=64, bits=4)

    first = run()
    mx.eval(first)
    second = run()
    mx.eval(second)
    with mx.stream(mx.cpu):
        on_cpu = run()
        mx.eval(on_cpu)
    return {"op": op, "rows": rows, "input width": width, "outputs": out_dims,
            f"{mx.default_device()} vs CPU": f"{relative_error(first, on_cpu):.2e}",
            "run to run": f"{relative_error(second, first):.2e}"}


def main():
    rows = [probe(op, *shape) for op in ("quantized_matmul", "gather_qmm") for shape in SHAPES]
    print(f"MLX {mx.__version__}, {mx.default_device()}")
    print(markdown_table(list(rows[0]), [list(row.values()) for row in rows]))


if __name__ == "__main__":
    main()
