"""What bounds the decode GEMV: the fp32 loop of moe_decode.cu's gate+up (rows_dot) taken apart.

    python3 -m benchmarks.decode_roofline                       # Mixtral's gate+up, 16 layers
    python3 -m benchmarks.decode_roofline --shape qwen3 --warps 4,8

A warp takes 4 rows of each of 2 matrices (gate and up) of a pair's expert, as the kernel's warps
do (moe_decode.GATE_UP_BLOCK), over --layers layers of the shape's routed pairs (Mixtral:
2 pairs, 4096 -> 14336; Qwen3: 8 pairs, 2048 -> 768), 4-bit g64 with bf16 scales and biases, one
bf16 activation row a pair; no routing; the shape's sizes as template constants. Three variants of the same loop, with moe_decode.cu's own
device code (load_vector, prescale, dot_vector):
- loads: the packed vectors, scales and biases loaded as the kernel loads them (8 vectors a lane
  in flight), xor-reduced: what the loads alone reach;
- arithmetic: the kernel's arithmetic on the rows of the first pair of the first layer, which
  every warp reads (L1 hits): what the arithmetic alone reaches;
- both: the kernel's loop.
Each as one launch over all layers, and as one launch a layer in one graph (a decode step's
layers: the kernel's tail at every launch). TB/s counts the weights, scales and biases a layer's
pairs read; medians of --reps after 3 warm-ups."""

import argparse

import mlx.core as mx

from mlx_moe_fix.kernels.sources import cuda_kernel_source

from .timing import bench, markdown_table

# hidden -> ffn of the gate+up, routed pairs at one token
SHAPES = {"mixtral": (4096, 14336, 2), "qwen3": (2048, 768, 8)}
MODES = {"loads": 0, "arithmetic": 1, "both": 2}
GROUP = 64

BODY = r"""
using namespace moe_decode;
const int lane = threadIdx.x % 32;
constexpr int per_layer = PAIRS * ROWS / 4, words = IN_DIM / 8, groups = IN_DIM / 64;
const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
if (warp >= dims[0]) return;
const int w = warp + dims[1] * per_layer;  // dims[1]: the launch's first layer
int pair = w / (ROWS / 4), first_row = w % (ROWS / 4) * 4;  // the layers' pairs, one after another
if (MODE == 1) pair = first_row = 0;
// the 8 rows' offsets, as rows_dot keeps them: from the matrices' bases
size_t rows[8];
#pragma unroll
for (int i = 0; i < 8; ++i) rows[i] = ((size_t)pair * 2 + i / 4) * ROWS + first_row + i % 4;
float acc[8];
#pragma unroll
for (int i = 0; i < 8; ++i) acc[i] = 0.f;
unsigned loaded = 0;
for (int v = lane; v < IN_DIM / 32; v += 32) {
  uint4 packed[8];
  __nv_bfloat16 scale[8], bias[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    packed[i] = reinterpret_cast<const uint4*>(wq + rows[i] * words)[v];
    scale[i] = s[rows[i] * groups + v / 2];
    bias[i] = b[rows[i] * groups + v / 2];
  }
  if (MODE == 0) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      loaded ^= packed[i].x ^ packed[i].y ^ packed[i].z ^ packed[i].w ^ __bfloat16_as_ushort(scale[i]) ^ __bfloat16_as_ushort(bias[i]);
  } else {
    float xs[32];
    moe_decode::load_vector<4>(xs, x + (size_t)pair * IN_DIM, v);
    float x_sum = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) x_sum += xs[i];
    moe_decode::prescale<4>(xs);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] += static_cast<float>(scale[i]) * moe_decode::dot_vector<4>(packed[i], xs) + static_cast<float>(bias[i]) * x_sum;
  }
}
float total = __uint_as_float(loaded);
#pragma unroll
for (int i = 0; i < 8; ++i) total += acc[i];
total = moe_common::warp_sum(total);
if (lane == 0) out[w] = total;
"""


def layer_bytes(hidden: int, ffn: int, pairs: int) -> int:
    """Bytes a layer's gate+up reads: 2 matrices of `ffn` rows a pair, 4-bit values and a bf16
    scale and bias per 64."""
    return pairs * 2 * ffn * (hidden // 2 + 2 * 2 * hidden // GROUP)


def layer_inputs(shape: str, layers: int) -> tuple:
    """(packed weights, scales, biases, activations) of `layers` layers' routed pairs: each pair's
    gate rows, then its up rows, pairs one after another."""
    hidden, ffn, pairs = SHAPES[shape]
    matrix_rows = layers * pairs * 2 * ffn
    wq = mx.random.randint(0, 2**31, (matrix_rows, hidden // 8)).astype(mx.uint32)
    s = (mx.random.normal((matrix_rows, hidden // GROUP)) * 0.01).astype(mx.bfloat16)
    b = (mx.random.normal((matrix_rows, hidden // GROUP)) * 0.01).astype(mx.bfloat16)
    x = mx.random.normal((layers * pairs, hidden)).astype(mx.bfloat16)
    return wq, s, b, x


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="mixtral")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--warps", default="4", help="warps per block, comma-separated")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args(argv)
    if not mx.cuda.is_available():
        raise SystemExit("decode_roofline times CUDA kernels: run it on a CUDA GPU")
    hidden, ffn, pairs = SHAPES[args.shape]
    layers = args.layers
    kernel = mx.fast.cuda_kernel(name="mlx_moe_fix_decode_roofline", input_names=["wq", "s", "b", "x", "dims"],
                                 output_names=["out"], source=BODY, header=cuda_kernel_source("moe_decode.cu", "gate_up")[0])
    wq, s, b, x = layer_inputs(args.shape, layers)
    mx.eval(wq, s, b, x)
    per_layer = pairs * ffn // 4  # warps

    def call(mode, layers_a_launch, warps):
        warps_a_launch = per_layer * layers_a_launch
        return [kernel(inputs=[wq, s, b, x, mx.array([warps_a_launch, first], dtype=mx.int32)],
                       template=[("MODE", mode), ("IN_DIM", hidden), ("ROWS", ffn), ("PAIRS", pairs)],
                       grid=(warps_a_launch * 32, 1, 1), threadgroup=(warps * 32, 1, 1),
                       output_shapes=[(layers * per_layer,)], output_dtypes=[mx.float32])[0]
                for first in range(0, layers, layers_a_launch)]

    columns = ["variant", "launches", "warps a block", "µs a layer", "TB/s"]
    rows = []
    for name, mode in MODES.items():
        for layers_a_launch, launches in ((layers, "one"), (1, "one a layer")):
            for warps in map(int, args.warps.split(",")):
                seconds = bench(lambda: call(mode, layers_a_launch, warps), 3, args.reps).median / layers
                rows.append([name, launches, warps, f"{seconds * 1e6:.1f}", f"{layer_bytes(hidden, ffn, pairs) / seconds / 1e12:.2f}"])
                print(markdown_table(columns, rows[-1:]), flush=True)
    print(f"\n{args.shape}: {layers} layers of {layer_bytes(hidden, ffn, pairs) / 1e6:.1f} MB (gate+up of {pairs} pairs)")
    print(markdown_table(columns, rows))


if __name__ == "__main__":
    main()
