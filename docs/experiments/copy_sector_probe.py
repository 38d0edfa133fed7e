"""The prefill down's activation copies alone, in four layouts: how many L2 sectors a warp's copy
asks for in each (under ncu) and how long the copies take.

    source .mlx-cuda/setup.sh
    ncu --clock-control none --section SourceCounters --kernel-name regex:copy_sector_probe \\
        -o probe python3 docs/experiments/copy_sector_probe.py --reps 1
    ncu --import probe.ncu-rep --page source --csv --print-source sass > probe.csv
    python3 -m benchmarks.prefill_ncu --sectors probe.csv --top 4
    python3 docs/experiments/copy_sector_probe.py            # the times, without ncu

Each block copies the 64 rows of its row tile, 64 values (128 bytes) a row per k-step, through a
3-stage cp.async pipeline into shared memory, as cuda/moe_prefill.cu's `grouped` GEMM copies its
activations (128 threads, 4 copies a thread a k-step), over a [tiles x 64, 768] bf16 array (Qwen3
T=2048's padded down rows), 16 blocks a tile (its column blocks). The layouts (LAYOUT):
  0 padded:     rows 144 bytes apart in shared memory (main's LDS = BK + 8 until the eighty-sixth
                stop), a warp's copy 4 rows x 128 bytes
  1 swizzled:   rows 128 bytes apart, 16-byte chunk c of row r at chunk c ^ (r % 8) (main's since
                the eighty-sixth stop)
  2 unpadded:   rows 128 bytes apart, chunks in order (a bound: the GEMM's fragment reads would
                meet bank conflicts)
  3 eight rows: padded, a warp's copy 8 rows x 64 bytes
                (docs/experiments/prefill-activation-copies-8-rows.patch)
In the padded down ncu counted 24 sectors a copy for 16 of bytes (docs/benchmarks.md, eighty-fifth
stop, item 2). Each block then folds its last stage's rows into one word a row, and the script
checks every layout's words against the array's (the layouts place every byte). On an H100
(docs/benchmarks.md, eighty-sixth stop, item 1): the padded and eight-row layouts ask for 24
sectors a copy, the swizzled and unpadded ones for 16; the swizzled copies run 1.55x faster.
"""

import argparse
import functools
import statistics
import time

import mlx.core as mx
import numpy as np

ROWS, K, BK, COLUMN_BLOCKS, THREADS, STAGES = 64, 768, 64, 16, 128, 3  # BK: values a row per k-step
LAYOUTS = {0: "padded", 1: "swizzled", 2: "unpadded", 3: "eight rows"}

SOURCE = r"""
  constexpr int CHUNKS = BK / 8, COPIES = ROWS * CHUNKS / THREADS;
  constexpr int LDS = LAYOUT == 0 || LAYOUT == 3 ? BK + 8 : BK;
  __shared__ __align__(128) __nv_bfloat16 ring[STAGES * ROWS * (BK + 8)];
  const int tile = blockIdx.x / COLUMN_BLOCKS, tid = threadIdx.x, k_steps = K / BK;
  // Where copy i of this thread goes: its row and 16-byte chunk, and that chunk's shared slot.
  auto row_of = [&](int i) {
    return LAYOUT == 3 ? (tid / 64 + i * (THREADS / 64)) * 8 + tid % 32 / 4 : (tid + i * THREADS) / CHUNKS;
  };
  const int chunk = LAYOUT == 3 ? (tid / 32) % 2 * 4 + tid % 4 : tid % CHUNKS;
  auto slot = [&](int r, int c) { return r * LDS + (LAYOUT == 1 ? c ^ (r % 8) : c) * 8; };
  auto load_stage = [&](int stage, int k0) {
    for (int i = 0; i < COPIES; ++i) {
      const int r = row_of(i);
      const unsigned destination = (unsigned)__cvta_generic_to_shared(&ring[stage * ROWS * (BK + 8) + slot(r, chunk)]);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(destination),
                   "l"(a + (size_t)(tile * ROWS + r) * K + k0 + chunk * 8));
    }
  };
  for (int s = 0; s < STAGES - 1; ++s) {
    load_stage(s, s * BK);
    asm volatile("cp.async.commit_group;\n" ::);
  }
  for (int step = 0; step < k_steps; ++step) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
    __syncthreads();
    const int ahead = step + STAGES - 1;
    if (ahead < k_steps) load_stage(ahead % STAGES, ahead * BK);
    asm volatile("cp.async.commit_group;\n" ::);
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
  __syncthreads();
  if (tid < ROWS) {  // the last k-step's row `tid`, folded: every layout must give the same words
    const __nv_bfloat16* stage = ring + (k_steps - 1) % STAGES * ROWS * (BK + 8);
    unsigned folded = 0;
    for (int c = 0; c < CHUNKS; ++c) {
      const uint4 v = *reinterpret_cast<const uint4*>(&stage[slot(tid, c)]);
      folded ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    out[blockIdx.x * ROWS + tid] = folded;
  }
"""


@functools.cache
def kernel(layout: int):
    return mx.fast.cuda_kernel(name=f"copy_sector_probe_{layout}", input_names=["a"], output_names=["out"], source=SOURCE)


def launch(a: mx.array, layout: int) -> mx.array:
    blocks = a.shape[0] // ROWS * COLUMN_BLOCKS
    (out,) = kernel(layout)(inputs=[a], template=[("LAYOUT", layout), ("ROWS", ROWS), ("K", K), ("BK", BK), ("THREADS", THREADS),
                                          ("STAGES", STAGES), ("COLUMN_BLOCKS", COLUMN_BLOCKS)],
                    grid=(blocks * THREADS, 1, 1), threadgroup=(THREADS, 1, 1), output_shapes=[(blocks * ROWS,)],
                    output_dtypes=[mx.uint32])
    return out


def expected_words(a: mx.array) -> np.ndarray:
    """Each tile row's last k-step folded into one word (as the kernel folds it), per block."""
    words_per_step = BK * 2 // 4  # bf16 values as uint32 words
    last = np.array(a.view(mx.uint32))[:, (K - BK) // 2:].reshape(-1, ROWS, words_per_step)
    words = np.bitwise_xor.reduce(last, axis=2).reshape(-1, 1, ROWS)
    return np.repeat(words, COLUMN_BLOCKS, axis=1).reshape(-1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiles", type=int, default=320, help="64-row tiles (Qwen3 T=2048's down: ~320)")
    parser.add_argument("--reps", type=int, default=21, help="timed launches per layout (1 under ncu)")
    args = parser.parse_args(argv)
    if not mx.cuda.is_available():
        raise SystemExit("copy_sector_probe launches CUDA kernels: run it on a CUDA GPU")
    a = mx.random.normal((args.tiles * ROWS, K)).astype(mx.bfloat16)
    mx.eval(a)
    want = expected_words(a)
    print("| layout | µs a launch | GB/s of activation bytes (16 column blocks each) | words match |")
    print("|---|---|---|---|")
    for layout, label in LAYOUTS.items():
        out = launch(a, layout)
        mx.eval(out)  # the warm-up (and NVRTC's compile)
        seconds = []
        for _ in range(args.reps):
            start = time.perf_counter()
            mx.eval(launch(a, layout))
            seconds.append(time.perf_counter() - start)
        match = bool(np.array_equal(np.array(out), want))
        median = statistics.median(seconds)
        print(f"| {label} | {median * 1e6:.1f} | {a.nbytes * COLUMN_BLOCKS / median / 1e9:.0f} | {match} |", flush=True)


if __name__ == "__main__":
    main()
