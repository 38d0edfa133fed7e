"""Trees of this repo whose grouped_wgmma (the prefill's gate+up GEMM on Hopper) leaves out one
part of its k-loop's work, to time against main with `benchmarks.prefill_ab` and so bound what
each part costs; and `pair`, a real variant: one barrier (and one `cp.async` wait and fence) a
pair of k-steps instead of every k-step, the next pair's stages loaded after it.

    python3 docs/experiments/prefill_wgmma_bounds.py scratch/bounds        # here: writes the trees
    python3 -m benchmarks.prefill_ab --other scratch/bounds/nodq --parts gate_up --rounds 3 \\
        --cases qwen3:2048,mixtral:2048                                        # on the GPU; carry scratch/

The edits read grouped_wgmma as it is since ebe982d (stop 68: the scale windows, a step's packed
words in one load) with stop 77's 4-bit values in place, and `grouped` as it is since c50f938
(stop 76: 4-bit values in place), both with stop 78's two instructions a pair (the scales kept
times 2^69 and 2^65, the biases times 2^-64); stop 66's trees (docs/benchmarks.md, sixty-sixth stop, item 2) were built from
c5b3817's kernel by the script of that commit. Where the kernel changes, the script stops with "no
longer reads as this script expects".

Every tree but `pair` computes wrong outputs by design (prefill_ab prints their difference); they
are measurements, not designs. `pair` passes the CPU emulation's prefill cases (run the tests in
a copy of the repo with its moe_prefill.cu: pytest puts the repo root first on sys.path).
  nodq:     the dequantisation left out: each A register is the packed word XOR its group's scale
            and bias (the words' and scales' loads stay; ptxas spills 28 bytes here, 4 local loads a
            k-step, where main spills none)
  nomma:    no wgmma issued (fence, commit and wait stay; the A registers summed into one
            accumulator so that the dequantisation stays)
  skeleton: both of those left out: the loads, the pipeline and the barriers alone
  noscale:  no scale or bias loads (constants in their place; the dequantisation stays)
  nobar:    no per-k-step fence or barrier (races between stages: timing only)
  grouped_noscale: noscale's edit in `grouped`, the mma.sync GEMM (the down launch, and gate+up
            at tiles under 64 rows): time it with `--parts down`
  grouped_nobar, grouped_noa, grouped_now, grouped_nodq, grouped_nomma, grouped_skeleton: the same
            parts left out of `grouped` (its k-step barrier; the activation copies, `noa`; the
            weight copies, `now`; the dequantisation; the mmas, each replaced by its operands
            XORed into an accumulator; both); time them with `--parts down`. Without its mmas the
            GEMM needs ~100 registers, not 168: those two trees ask for 66 KB of shared memory a
            block so that they too run three blocks a SM
"""

import subprocess
import sys
from pathlib import Path

DEQUANT = """af[m][2 * h + h8] = dequant_pair_at<T, S, BITS, FP4>(word >> 8 * s, 4 * h, group_scale[m][h8], group_bias[m][h8]);"""
NO_DEQUANT = """af[m][2 * h + h8] = word ^ (*reinterpret_cast<const unsigned short*>(&group_scale[m][h8]) |
                                              (unsigned)*reinterpret_cast<const unsigned short*>(&group_bias[m][h8]) << 16);"""
MMA = "wgmma<T, BM>(acc[m], af[m], wgmma_descriptor(b_stage + (2 * half + s) * 32));"
# ptxas drops whatever only fed the wgmma (an empty asm is no use in PTX): the registers go into
# one accumulator instead, 3 instructions a matrix and k16 step where the wgmma was 1.
NO_MMA = "acc[m][0] += __uint_as_float(af[m][0] ^ af[m][1] ^ af[m][2] ^ af[m][3]);"
# grouped's scale loads (a row's group each k-step; `grouped_noscale`)
SCALES = """group_scale[m][j] = group_scale_of<T, BITS, FP4, GROUP>((m == 0 ? s0 : s1)[at]);
        if constexpr (!FP4) group_bias[m][j] = group_bias_of<T, BITS, FP4>((m == 0 ? b0 : b1)[at]);"""
NO_SCALES = """group_scale[m][j] = group_scale_of<T, BITS, FP4, GROUP>(static_cast<S>(1.f + at % 2));
        if constexpr (!FP4) group_bias[m][j] = static_cast<S>(0.f);"""
# grouped_wgmma's: each k-step's value from its window (or, for rows not of whole words, its own
# load); without them the windows' loads feed nothing and go too
WINDOW_SCALES = """        if (windows) {
          group_scale[m][h8] = group_scale_of<T, BITS, FP4, GROUP>(word_value<S>(__shfl_sync(0xffffffffu, held_scale[m][h8], from) >> shift));
          if constexpr (!FP4) group_bias[m][h8] = group_bias_of<T, BITS, FP4>(word_value<S>(__shfl_sync(0xffffffffu, held_bias[m][h8], from) >> shift));
        } else {
          const size_t at = row_start(h8) + group;
          group_scale[m][h8] = group_scale_of<T, BITS, FP4, GROUP>((m == 0 ? s0 : s1)[at]);
          if constexpr (!FP4) group_bias[m][h8] = group_bias_of<T, BITS, FP4>((m == 0 ? b0 : b1)[at]);
        }"""
NO_WINDOW_SCALES = """        group_scale[m][h8] = group_scale_of<T, BITS, FP4, GROUP>(static_cast<S>(1.f + (group + h8) % 2));
        if constexpr (!FP4) group_bias[m][h8] = static_cast<S>(0.f);"""
# grouped's (the mma.sync GEMM's) k-loop: its barrier, its copies, its dequantisation, its mmas
GROUPED_BARRIER = """    asm volatile("cp.async.wait_group %0;\\n" ::"n"(STAGES - 2));
    __syncthreads();"""
GROUPED_NO_BARRIER = """    asm volatile("cp.async.wait_group %0;\\n" ::"n"(STAGES - 2));"""
GROUPED_A_COPY = """      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n" ::"r"(smem_address(&a_dst[r * LDS + a_slot * 8])),
                   "l"(a + a_offset[i] + k0), "r"((a_present >> i & 1u) * 16));"""
GROUPED_W_COPY = """      w_copies.copy(reinterpret_cast<const unsigned char*>(m == 0 ? w0 : w1) + (size_t)k0 * BITS / 8,
                    sw + (stage * MATRICES + m) * W_STAGE_BYTES, tid);"""
GROUPED_DEQUANT = """            const unsigned b_lo = dequant_pair_at<T, S, BITS, FP4>(word >> shift, 0, group_scale[m][j], group_bias[m][j]);
            const unsigned b_hi = dequant_pair_at<T, S, BITS, FP4>(word >> shift, BITS, group_scale[m][j], group_bias[m][j]);"""
GROUPED_NO_DEQUANT = """            const unsigned affine = *reinterpret_cast<const unsigned short*>(&group_scale[m][j]) |
                                    (unsigned)*reinterpret_cast<const unsigned short*>(&group_bias[m][j]) << 16;
            const unsigned b_lo = word >> shift ^ affine, b_hi = word >> (shift + BITS) ^ affine;"""
GROUPED_MMA = "for (int mi = 0; mi < MI; ++mi) mma<T>(acc[m][mi][j], af[mi][s], b_lo, b_hi);"
GROUPED_NO_MMA = ("for (int mi = 0; mi < MI; ++mi) acc[m][mi][j][0] += __uint_as_float(b_lo ^ b_hi ^ af[mi][s][0] ^ af[mi][s][1] ^ "
                  "af[mi][s][2] ^ af[mi][s][3]);")
BARRIER = """    asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");
    __syncthreads();
"""
PROLOGUE = """  for (int s = 0; s < WGMMA_AHEAD; ++s) {
    if (s < k_steps) load_stage(s, s * BK);
    asm volatile("cp.async.commit_group;\\n" ::);
  }"""
PAIR_PROLOGUE = """  for (int s = 0; s < 2; ++s)
    if (s < k_steps) load_stage(s, s * BK);
  asm volatile("cp.async.commit_group;\\n" ::);"""
LOOP_HEAD = """    asm volatile("cp.async.wait_group %0;\\n" ::"n"(WGMMA_AHEAD - 1));
    // this thread's cp.async writes, visible to the wgmmas' (async proxy) reads after the barrier
    asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");
    __syncthreads();
    // The stage refilled here was read two k-steps back: every warpgroup has since waited until
    // at most its last k16 step's wgmmas were pending, and every thread has passed the barrier.
    const int ahead = step + WGMMA_AHEAD;
    if (ahead < k_steps) load_stage(ahead % WGMMA_STAGES, ahead * BK);
    asm volatile("cp.async.commit_group;\\n" ::);"""
# Of the 5 stages, a pair's two are read, the last stage of the pair before may still be read by
# its last wgmmas, and the two read three and two k-steps back are refilled.
PAIR_LOOP_HEAD = """    if (step % 2 == 0) {
      asm volatile("cp.async.wait_group %0;\\n" ::"n"(0));
      asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");
      __syncthreads();
      for (int ahead = step + 2; ahead < step + 4 && ahead < k_steps; ++ahead) load_stage(ahead % WGMMA_STAGES, ahead * BK);
      asm volatile("cp.async.commit_group;\\n" ::);
    }"""

# the one-matrix GEMM's shared memory raised to keep its blocks three a SM (of 228 KB)
SHARED_BYTES = "    return PIPELINE_STAGES * (tile * SHARED_ROW * 2 + weights)"
THREE_BLOCKS_SHARED_BYTES = "    return max(PIPELINE_STAGES * (tile * SHARED_ROW * 2 + weights), 66 * 1024)"
THREE_BLOCKS = [(SHARED_BYTES, THREE_BLOCKS_SHARED_BYTES)]

# {tree: (the section of moe_prefill.cu it edits, its edits[, edits of moe_prefill.py])}
VARIANTS = {
    "pair": ("grouped_wgmma", [(PROLOGUE, PAIR_PROLOGUE), (LOOP_HEAD, PAIR_LOOP_HEAD)]),
    "nodq": ("grouped_wgmma", [(DEQUANT, NO_DEQUANT)]),
    "nomma": ("grouped_wgmma", [(MMA, NO_MMA)]),
    "skeleton": ("grouped_wgmma", [(DEQUANT, NO_DEQUANT), (MMA, NO_MMA)]),
    "noscale": ("grouped_wgmma", [(WINDOW_SCALES, NO_WINDOW_SCALES)]),
    "nobar": ("grouped_wgmma", [(BARRIER, "")]),
    "grouped_noscale": ("grouped", [(SCALES, NO_SCALES)]),
    "grouped_nobar": ("grouped", [(GROUPED_BARRIER, GROUPED_NO_BARRIER)]),
    "grouped_noa": ("grouped", [(GROUPED_A_COPY, "")]),
    "grouped_now": ("grouped", [(GROUPED_W_COPY, "      ;")]),
    "grouped_nodq": ("grouped", [(GROUPED_DEQUANT, GROUPED_NO_DEQUANT)]),
    "grouped_nomma": ("grouped", [(GROUPED_MMA, GROUPED_NO_MMA)], THREE_BLOCKS),
    "grouped_skeleton": ("grouped", [(GROUPED_DEQUANT, GROUPED_NO_DEQUANT), (GROUPED_MMA, GROUPED_NO_MMA)], THREE_BLOCKS),
}


def write_tree(directory: Path, kernel: str, edits, launcher_edits=()) -> None:
    """HEAD's mlx_moe_fix under `directory`, the section `kernel` of moe_prefill.cu edited (each
    edit found once), and moe_prefill.py by `launcher_edits`."""
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(f"git archive HEAD mlx_moe_fix | tar -x -C {directory}", shell=True, check=True)
    source = directory / "mlx_moe_fix/kernels/cuda/moe_prefill.cu"
    text = source.read_text()
    start = text.index(f"//// {kernel}\n")
    end = text.index("\n//// ", start)
    section = text[start:end]
    for old, new in edits:
        if section.count(old) != 1:
            raise SystemExit(f"{directory.name}: {kernel} no longer reads as this script expects ({old[:60]!r})")
        section = section.replace(old, new)
    source.write_text(text[:start] + section + text[end:])
    launcher = directory / "mlx_moe_fix/kernels/moe_prefill.py"
    code = launcher.read_text()
    for old, new in launcher_edits:
        if code.count(old) != 1:
            raise SystemExit(f"{directory.name}: moe_prefill.py no longer reads as this script expects ({old[:60]!r})")
        code = code.replace(old, new)
    launcher.write_text(code)


def main(argv) -> None:
    if not argv:
        raise SystemExit(__doc__)
    root = Path(argv[0])
    for name in argv[1:] or VARIANTS:
        write_tree(root / name, *VARIANTS[name])
        print(f"{root / name}: {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
