"""How fast this GPU's SMs can read from L2 (and from DRAM), with the copies our prefill GEMMs use:
the ceiling against which docs/experiments/prefill_l2_traffic_model.py's bytes are read.

    source .mlx-cuda/setup.sh && python3 docs/experiments/l2_bandwidth_probe.py

Each launch reads a buffer `--repeats` times over, every block's threads taking 16-byte pieces
grid-stride, either with `ld.global.cg` into registers (folded into one word a thread, written
out so that nothing is left unread) or with `cp.async.cg` into a ring of shared-memory stages
(STAGES - 1 groups in flight, as the GEMMs' pipelines keep them). A buffer of --l2-mib (within
L2) gives the L2-to-SM rate once its first pass has brought it into L2; one of --dram-mib (past
L2) the DRAM rate. Blocks of 256 threads, --blocks-per-sm of them per SM. Median of --reps timed
evaluations after a warm-up one; the launch's fixed cost counts in (~0.02 ms against the
--repeats' ~0.5 ms).

First run at the eighty-third stop on an H100 (docs/benchmarks.md, eighty-third stop, item 3): L2
4.3-4.7 TB/s to the SMs, DRAM 2.6-2.8 TB/s.
"""

import argparse
import statistics
import time

import mlx.core as mx

THREADS = 256
STAGES = 8

LOADS = r"""
  const uint4* pieces = reinterpret_cast<const uint4*>(buffer);
  const size_t stride = (size_t)gridDim.x * blockDim.x, first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  unsigned folded = 0;
  for (int r = 0; r < REPEATS; ++r)
    for (size_t i = first; i < PIECES; i += stride) {
      const uint4 v = __ldcg(pieces + i);
      folded ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  out[first] = folded;
"""

COPIES = r"""
  __shared__ __align__(16) unsigned char ring[STAGES * THREADS_PER_BLOCK * 16];
  const unsigned char* bytes = reinterpret_cast<const unsigned char*>(buffer);
  const size_t stride = (size_t)gridDim.x * blockDim.x, first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned slot = (unsigned)__cvta_generic_to_shared(ring + threadIdx.x * 16);
  int stage = 0;
  for (int r = 0; r < REPEATS; ++r)
    for (size_t i = first; i < PIECES; i += stride) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(slot + stage * THREADS_PER_BLOCK * 16), "l"(bytes + i * 16));
      asm volatile("cp.async.commit_group;\n" ::);
      asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 1));
      stage = (stage + 1) % STAGES;
    }
  asm volatile("cp.async.wait_group 0;\n" ::);
  out[first] = *reinterpret_cast<const unsigned*>(ring + threadIdx.x * 16);
"""


def kernel(kind: str):
    return mx.fast.cuda_kernel(name=f"l2_bandwidth_probe_{kind}", input_names=["buffer"], output_names=["out"],
                               source=LOADS if kind == "loads" else COPIES)


def rate(kind: str, mib: int, repeats: int, blocks: int, reps: int) -> float:
    """GB/s read by one launch over a buffer of `mib` MiB, `repeats` passes."""
    pieces = mib * 2**20 // 16
    buffer = mx.random.randint(0, 2**30, (pieces * 4,), dtype=mx.int32).astype(mx.uint32)
    mx.eval(buffer)
    launch = kernel(kind)

    def call():
        (out,) = launch(inputs=[buffer], template=[("PIECES", pieces), ("REPEATS", repeats), ("STAGES", STAGES),
                                                   ("THREADS_PER_BLOCK", THREADS)],
                        grid=(blocks * THREADS, 1, 1), threadgroup=(THREADS, 1, 1), output_shapes=[(blocks * THREADS,)],
                        output_dtypes=[mx.uint32])
        mx.eval(out)

    call()
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return repeats * pieces * 16 / statistics.median(seconds) / 1e9


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--l2-mib", type=int, default=16)
    parser.add_argument("--dram-mib", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=40, help="passes over the L2 buffer a launch (1 over DRAM's)")
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--blocks-per-sm", default="4,8", help="comma-separated")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args(argv)
    print("| read | buffer | blocks a SM | GB/s |")
    print("|---|---|---|---|")
    for per_sm in map(int, args.blocks_per_sm.split(",")):
        for kind in ("loads", "copies"):
            for label, mib, repeats in (("L2", args.l2_mib, args.repeats), ("DRAM", args.dram_mib, 1)):
                print(f"| {kind} | {label} {mib} MiB | {per_sm} | {rate(kind, mib, repeats, args.sms * per_sm, args.reps):.0f} |",
                      flush=True)


if __name__ == "__main__":
    main()
