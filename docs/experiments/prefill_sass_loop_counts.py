"""Instructions a k-step in the prefill GEMMs' k-loops, and the code before and after the loop
(set-up; epilogue and stores), read from their SASS (no GPU): each GEMM
compiled by nvcc for sm_90a as MLX builds it (tests/test_cuda_sources.py's translation units,
under the package's launch bounds; bf16 activations and scales, 4-bit g64), disassembled by
nvdisasm, the longest loop holding the tensor-core instruction counted by opcode.

    pip install nvidia-cuda-nvdisasm          # the nvdisasm binary under nvidia/cu13/bin
    PYTHONPATH=<tree> python3 docs/experiments/prefill_sass_loop_counts.py NVDISASM

<tree> holds the mlx_moe_fix to read (this repo's, or one with an experiment applied); run from
the repo root (its tests/ give the compile helpers). docs/benchmarks.md, sixty-fifth stop item 3,
sixty-ninth stop item 5.
"""

import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.append("tests")
import test_cuda_sources as sources  # noqa: E402

# (GEMM, tile, gated, in_dim): wgmma's blocks of 128 and 256 rows (moe_prefill.wgmma_block_rows)
KERNELS = [("grouped_wgmma", 64, True, 2048), ("grouped_wgmma", 64, True, 4096)]
KERNELS += [("grouped", tile, gated, 2048) for gated in (True, False) for tile in (16, 32, 64)]
INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def loop_opcodes(sass: str, mma: str) -> tuple:
    """Opcodes of the longest loop (a label and the backward branch to it) holding `mma`, and the
    instructions before and after it."""
    lines = sass.splitlines()
    labels = {line[1:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\.L_x_\d+:", line)}
    loops = [(labels[m[1]], i) for i, line in enumerate(lines) if (m := re.search(r"BRA `\(\.(L_x_\d+)\)", line))
             and labels.get(m[1], i) < i and any(mma in x for x in lines[labels[m[1]]:i])]
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    count = lambda part: sum(1 for line in part if INSTRUCTION.match(line))  # noqa: E731
    return (collections.Counter(m[1] for line in lines[start:end + 1] if (m := INSTRUCTION.match(line))),
            count(lines[:start]), count(lines[end + 1:]))


def main(nvdisasm: str) -> None:
    for stage, tile, gated, in_dim in KERNELS:
        constants = {"BITS": 4, "GROUP": 64, "FP4": False, "BM": tile, "PAIRS_IN": gated, "ACTIVATE": gated, "GATED": gated,
                     "ACT": 0, "LIMITED": False, "HAS_BIAS": False}
        if stage == "grouped_wgmma":
            constants["RBN"] = sources.PREFILL.block_n(stage, in_dim)
        bounds = sources.PREFILL.launch_bounds_for(tile, gated, stage, in_dim)
        (text,) = sources.translation_units(sources.PREFILL, "moe_prefill.cu", [(stage, "__nv_bfloat16", constants)])
        with tempfile.TemporaryDirectory() as directory:
            (usage,) = sources.compile_all(Path(directory), [sources.with_launch_bounds(text, "moe_prefill.cu", stage, bounds)],
                                           "--resource-usage")
            sass = subprocess.run([nvdisasm, "-c", str(Path(directory) / "kernels0.cubin")], capture_output=True, text=True,
                                  check=True).stdout
        opcodes, before, after = loop_opcodes(sass, "HGMMA" if stage == "grouped_wgmma" else "HMMA")
        spills = re.search(r"(\d+) bytes spill stores", usage)[1]
        registers = re.search(r"Used (\d+) registers", usage)[1]
        top = " ".join(f"{op}:{n}" for op, n in opcodes.most_common(8))
        width = f" RBN {constants['RBN']}" if "RBN" in constants else ""
        print(f"{stage}{width} BM {tile} {'gated' if gated else 'down'}: {sum(opcodes.values())} instructions a k-step, "
              f"{before} before the loop and {after} after, {registers} registers, {spills} bytes spilled; {top}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
