"""The prefill down's weight copies alone, in two layouts: how many L2 sectors, L1 tags and shared
wavefronts a warp's copy takes in each (under ncu) and how long the copies take.

    source .mlx-cuda/setup.sh
    ncu --clock-control none --section SourceCounters --kernel-name regex:weight_copy_probe \\
        -o wprobe python3 docs/experiments/weight_copy_probe.py --reps 1
    ncu --import wprobe.ncu-rep --page source --csv --print-source sass > wprobe.csv
    python3 -m benchmarks.prefill_ncu --sectors wprobe.csv --top 4
    python3 docs/experiments/weight_copy_probe.py                 # the times, without ncu
    python3 docs/experiments/weight_copy_probe.py --k 14336 --out 4096 --experts 8 --tiles 64  # Mixtral's

Each block copies its 128 weight rows (4-bit, K / 2 bytes a row) of its tile's expert, as
cuda/moe_prefill.cu's `grouped` GEMM copies them for the down (128 threads), over [experts, out,
K / 2] bytes; out / 128 column blocks a tile, the tile's expert `tile % experts`. The layouts
(LAYOUT):
  0 k-steps:  main's: each k-step (64 values, 32 bytes a row) through a 3-stage cp.async ring, rows
              32 bytes apart in shared memory; a warp's copy takes 16 rows x 32 bytes, so 16
              128-byte lines (main's down: 16 L1 tags and 16 shared wavefronts a request where
              its 512 bytes would fill 4; docs/benchmarks.md, eighty-fifth stop, item 2)
  1 lines:    128 bytes a row (4 k-steps) at a time, into one of two buffers, loaded two k-steps
              before its first k-step; rows 128 bytes apart, 16-byte chunk c of row r at c ^ (r % 8)
              (a k-step's reads of 8 rows then fall on distinct banks); a warp's copy takes 4 rows x
              128 bytes: 4 lines
Both keep one barrier a k-step and a cp.async group a k-step (layout 1's groups empty on three k-steps
of four), as the GEMM would. Each block then folds the last k-step's 32 bytes of each row into a
word, and the script checks both layouts' words against the array's. The question for the GEMM:
whether the 4x fewer lines and wavefronts a copy make the copies faster (docs/benchmarks.md,
eighty-sixth stop: main's down without its weight copies, a bound, was 4.6% faster at Qwen3
T=2048 and 8% at Mixtral's, seventy-sixth stop). Not yet run on a GPU: both layouts' words match
the array's in the tests' CPU emulation (tests/cuda_emulation.py's EmulatedCudaKernel for
mx.fast.cuda_kernel, K 768 and 1024), and nvcc compiles them for sm_90a (18 and 32 registers).
"""

import argparse
import functools
import statistics
import time

import mlx.core as mx
import numpy as np

ROWS, BK, THREADS, STAGES, LINE = 128, 64, 128, 3, 128  # ROWS: weight rows a block; BK: values a k-step
STEP_BYTES = BK // 2  # a row's 4-bit bytes a k-step
LAYOUTS = {0: "k-steps", 1: "lines"}

SOURCE = r"""
  constexpr int STEP_BYTES = BK / 2, STEPS_PER_LINE = LINE / STEP_BYTES;
  constexpr int STEP_COPIES = ROWS * STEP_BYTES / 16 / THREADS, LINE_COPIES = ROWS * LINE / 16 / THREADS;
  extern __shared__ __align__(128) unsigned char ring[];  // ring_bytes(LAYOUT)
  const int column_blocks = OUT / ROWS, tid = threadIdx.x, k_steps = K / BK;
  const int tile = blockIdx.x / column_blocks, column_block = blockIdx.x % column_blocks;
  const unsigned char* rows = reinterpret_cast<const unsigned char*>(w) +
                              ((size_t)(tile % EXPERTS) * OUT + column_block * ROWS) * (K / 2);
  // layout 1: 16-byte chunk c of row r at chunk c ^ (r % 8) of its 128 shared bytes
  auto line_slot = [&](int r, int c) { return r * LINE + (c ^ (r % 8)) * 16; };
  auto copy = [&](unsigned char* to, const unsigned char* source) {
    const unsigned destination = (unsigned)__cvta_generic_to_shared(to);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(destination), "l"(source), "r"(16));
  };
  auto load_step = [&](int step) {  // what k-step `step` needs loaded STAGES - 1 steps ahead
    if constexpr (LAYOUT == 0) {
      for (int i = 0; i < STEP_COPIES; ++i) {
        const int c = tid + i * THREADS, r = c / (STEP_BYTES / 16), part = c % (STEP_BYTES / 16);
        copy(ring + (step % STAGES) * ROWS * STEP_BYTES + c * 16, rows + (size_t)r * (K / 2) + step * STEP_BYTES + part * 16);
      }
    } else if (step % STEPS_PER_LINE == 0) {
      const int line = step / STEPS_PER_LINE;
      for (int i = 0; i < LINE_COPIES; ++i) {
        const int c = tid + i * THREADS, r = c / (LINE / 16), chunk = c % (LINE / 16);
        copy(ring + (line % 2) * ROWS * LINE + line_slot(r, chunk), rows + (size_t)r * (K / 2) + line * LINE + chunk * 16);
      }
    }
  };
  for (int s = 0; s < STAGES - 1; ++s) {
    load_step(s);
    asm volatile("cp.async.commit_group;\n" ::);
  }
  for (int step = 0; step < k_steps; ++step) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
    __syncthreads();
    const int ahead = step + STAGES - 1;
    if (ahead < k_steps) load_step(ahead);
    asm volatile("cp.async.commit_group;\n" ::);
  }
  asm volatile("cp.async.wait_group %0;\n" ::"n"(0));
  __syncthreads();
  if (tid < ROWS) {  // the last k-step's bytes of row `tid`, folded: both layouts must give the same words
    const int last = k_steps - 1;
    unsigned folded = 0;
    for (int part = 0; part < STEP_BYTES / 16; ++part) {
      const unsigned char* at = LAYOUT == 0
          ? ring + (last % STAGES) * ROWS * STEP_BYTES + tid * STEP_BYTES + part * 16
          : ring + (last / STEPS_PER_LINE % 2) * ROWS * LINE +
                line_slot(tid, last % STEPS_PER_LINE * (STEP_BYTES / 16) + part);
      const uint4 v = *reinterpret_cast<const uint4*>(at);
      folded ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    out[blockIdx.x * ROWS + tid] = folded;
  }
"""


def ring_bytes(layout: int) -> int:
    """Layout 0: STAGES k-steps of ROWS rows; layout 1: two buffers of ROWS whole lines."""
    return STAGES * ROWS * STEP_BYTES if layout == 0 else 2 * ROWS * LINE


@functools.cache
def kernel(layout: int):
    return mx.fast.cuda_kernel(name=f"weight_copy_probe_{layout}", input_names=["w"], output_names=["out"], source=SOURCE,
                               shared_memory=ring_bytes(layout))


def launch(w: mx.array, tiles: int, layout: int) -> mx.array:
    experts, out_dim, k = w.shape[0], w.shape[1], w.shape[2] * 8
    blocks = tiles * out_dim // ROWS
    (out,) = kernel(layout)(inputs=[w], template=[("LAYOUT", layout), ("ROWS", ROWS), ("K", k), ("OUT", out_dim),
                                          ("EXPERTS", experts), ("BK", BK), ("THREADS", THREADS),
                                          ("STAGES", STAGES), ("LINE", LINE)],
                    grid=(blocks * THREADS, 1, 1), threadgroup=(THREADS, 1, 1), output_shapes=[(blocks * ROWS,)],
                    output_dtypes=[mx.uint32])
    return out


def expected_words(w: mx.array, tiles: int) -> np.ndarray:
    """Each block's rows' last k-step folded into one word (as the kernel folds it)."""
    experts = w.shape[0]
    last = np.array(w)[:, :, -STEP_BYTES // 4:]  # [experts, out, the last k-step's words]
    folded = np.bitwise_xor.reduce(last, axis=2)  # [experts, out]
    return folded[np.arange(tiles) % experts].reshape(-1)  # block order: tile, then column block, then row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiles", type=int, default=320, help="64-row tiles (Qwen3 T=2048's down: ~320)")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--out", type=int, default=2048, help="weight rows an expert (the down's output width)")
    parser.add_argument("--k", type=int, default=768, help="the down's input width (a multiple of 256)")
    parser.add_argument("--reps", type=int, default=21, help="timed launches per layout (1 under ncu)")
    args = parser.parse_args(argv)
    if args.k % (LINE * 2) or args.out % ROWS:
        raise SystemExit(f"--k must be a multiple of {LINE * 2} and --out of {ROWS}")
    if not mx.cuda.is_available():
        raise SystemExit("weight_copy_probe launches CUDA kernels: run it on a CUDA GPU")
    words = args.experts * args.out * args.k // 8
    w = mx.random.randint(0, 2**31, (words,), dtype=mx.int32).view(mx.uint32).reshape(args.experts, args.out, args.k // 8)
    mx.eval(w)
    want = expected_words(w, args.tiles)
    copied = args.tiles * args.out * args.k // 2  # bytes the blocks copy
    print("| layout | µs a launch | GB/s of weight bytes copied | words match |")
    print("|---|---|---|---|")
    for layout, label in LAYOUTS.items():
        out = launch(w, args.tiles, layout)
        mx.eval(out)  # the warm-up (and NVRTC's compile)
        seconds = []
        for _ in range(args.reps):
            start = time.perf_counter()
            mx.eval(launch(w, args.tiles, layout))
            seconds.append(time.perf_counter() - start)
        match = bool(np.array_equal(np.array(out), want))
        median = statistics.median(seconds)
        print(f"| {label} | {median * 1e6:.1f} | {copied / median / 1e9:.0f} | {match} |", flush=True)


if __name__ == "__main__":
    main()
