"""The prefill GEMM launches alone, for ncu, and a table of where their warps stall.

    ncu --section SourceCounters --section WarpStateStats --section SpeedOfLight --kernel-name regex:grouped \\
        --launch-skip 2 --launch-count 2 -o prefill -f python3 -m benchmarks.prefill_ncu --cases qwen3:2048
    ncu -i prefill.ncu-rep --page source --csv --print-source sass > source.csv
    python3 -m benchmarks.prefill_ncu --stalls source.csv   # per kernel: stall samples by SASS opcode
    python3 -m benchmarks.prefill_ncu --sectors source.csv  # per kernel: L2 sectors by instruction

One quantized mlx-lm SwitchGLU per case (4-bit g64 bf16, random routing, as benchmarks.prefill_ab
builds it) and its CUDA prefill GEMM launches: per case the routing and one gate+up launch are
made while building, then each part in --parts (`gate_up`: the first launch, on wgmma where
moe_prefill.gemm_kernel takes it; `down`: the last) --calls times after one warm call. So with
--parts gate_up,down and --calls 1 each case launches "grouped" kernels in the order gate+up (build),
gate+up x 2, down x 2: `--launch-skip 2 --launch-count 2` profiles one timed gate+up and the first
down. The whole layer is checked against moe_prefill_reference once per case.

--stalls reads ncu's source page (`--page source --csv --print-source sass`, from a report taken
with the SourceCounters section) and prints, per kernel, the share of warp-stall samples each
opcode takes with its leading stall reasons, then the instructions with the most samples; first
their split before, in and after the kernel's main loop (`regions`: where a short k-loop's
prologue and epilogue weigh). --sectors reads the same page and prints, per kernel, the global
loads and stores that ask L2 for the most sectors, per warp request against the fewest their bytes
need (docs/benchmarks.md, eighty-fifth stop, item 2).
"""

import argparse
import collections
import csv
import importlib
import io
import re

import mlx.core as mx

from .prefill_ab import build_case, part_calls
from .switch_glu import experts_of
from .timing import markdown_table, relative_error

PARTS = ("gate_up", "down")
SAMPLES = "Warp Stall Sampling (All Samples)"


def run(cases: list, parts: list, calls: int) -> None:
    package = importlib.import_module("mlx_moe_fix.kernels")
    prefill = importlib.import_module("mlx_moe_fix.kernels.moe_prefill")
    for case in cases:
        shape, tokens = case.split(":")
        layer, x, indices, weights = build_case(shape, int(tokens))
        experts = experts_of(layer, package)
        calls_of = part_calls(prefill, experts, x, indices, weights)
        for part in parts:
            for _ in range(1 + calls):
                mx.eval(calls_of[part][0]())
        error = relative_error(calls_of["layer"][0](), prefill.moe_prefill_reference(x, indices, experts, weights))
        print(f"check {case}: layer against moe_prefill_reference, relative error {error:.2e}", flush=True)


def kernel_label(name: str) -> str:
    """A prefill GEMM's label: GEMM, launch bounds, source digest and template arguments."""
    ours = re.search(r"moe_prefill_(grouped_wgmma|grouped)_smem\d+(_lb\d+x\d+)?_([0-9a-f]{12})_(\w*)", name.split("(")[0])
    return f"{ours.group(1)}{ours.group(2) or ''} {ours.group(3)[:4]} {ours.group(4)}" if ours else name.split("(")[0][-48:]


def opcode(source: str) -> str:
    """`@!P0 LDG.E.U16 R1, [R2]` -> LDG."""
    words = [word for word in source.split() if not word.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def branch_target(source: str):
    """`@P0 BRA 0x7fd08f7be660` -> 0x7fd08f7be660; None for any other instruction."""
    words = [word for word in source.split() if not word.startswith("@")]
    if len(words) == 2 and words[0].split(".")[0] == "BRA" and words[1].startswith("0x"):
        return int(words[1], 16)
    return None


def regions(rows: list) -> list:
    """The kernel's stall samples before its main loop, in it and after it, as [(region, samples)]:
    the main loop is the span of the backward branch whose span holds the most samples (the
    GEMMs' k-loop; the loops inside it are unrolled), so that a short k-loop's prologue and
    epilogue show apart from it. Without a backward branch, all samples are "no loop"."""
    if not rows:
        return [("no loop", 0)]
    address = next(key for key in rows[0] if key.lstrip("# ").startswith("Address"))  # ncu's header: "Address" or "# Address"
    at = [int(row[address], 16) for row in rows]
    samples = [int(row[SAMPLES]) for row in rows]
    spans = []
    for i, row in enumerate(rows):
        target = branch_target(row["Source"])
        if target is not None and target <= at[i]:
            spans.append((sum(n for a, n in zip(at, samples) if target <= a <= at[i]), target, at[i]))
    if not spans:
        return [("no loop", sum(samples))]
    _, start, end = max(spans)
    before = sum(n for a, n in zip(at, samples) if a < start)
    inside = sum(n for a, n in zip(at, samples) if start <= a <= end)
    return [("before the main loop", before), ("main loop", inside), ("after it", sum(samples) - before - inside)]


def kernel_pages(text: str) -> list:
    """ncu's source page (csv, SASS) -> [(kernel name, its rows as dicts by column)]."""
    pages = []
    for section in re.split(r'^(?="Kernel Name")', text, flags=re.M):
        lines = section.splitlines()
        if lines and lines[0].startswith('"Kernel Name"'):
            pages.append((next(csv.reader([lines[0]]))[1], list(csv.DictReader(io.StringIO("\n".join(lines[1:]))))))
    return pages


def stalls(text: str, top: int = 12) -> list:
    """ncu's source page (csv, SASS) -> per kernel (label, samples, by-opcode rows, top-instruction
    rows); each row holds the share of the kernel's stall samples and its leading reasons."""
    kernels = []
    for name, rows in kernel_pages(text):
        reasons = [key for key in (rows[0] if rows else {}) if key.startswith("stall_") and "Not Issued" not in key]
        total = sum(int(row[SAMPLES]) for row in rows) or 1

        def leading(counter) -> str:
            return ", ".join(f"{key[6:]} {value * 100 / total:.1f}" for key, value in counter.most_common(3) if value)

        by_opcode, opcode_reasons = collections.Counter(), collections.defaultdict(collections.Counter)
        for row in rows:
            op = opcode(row["Source"])
            by_opcode[op] += int(row[SAMPLES])
            opcode_reasons[op].update({key: int(row[key]) for key in reasons})
        opcodes = [(op, f"{samples * 100 / total:.1f}", leading(opcode_reasons[op])) for op, samples in by_opcode.most_common(top)]
        busiest = sorted(rows, key=lambda row: -int(row[SAMPLES]))[:top]
        instructions = [(row["Source"].strip()[:56], f"{int(row[SAMPLES]) * 100 / total:.2f}",
                         leading(collections.Counter({key: int(row[key]) for key in reasons}))) for row in busiest]
        split = [(region, f"{n * 100 / total:.1f}") for region, n in regions(rows)]
        kernels.append((kernel_label(name), total, opcodes, instructions, split))
    return kernels


def print_stalls(kernels: list) -> None:
    for label, total, opcodes, instructions, split in kernels:
        print(f"\n### {label}: {total} stall samples\n")
        print(markdown_table(["region", "% of samples"], split))
        print()
        print(markdown_table(["opcode", "% of samples", "leading reasons (% of samples)"], opcodes))
        print()
        print(markdown_table(["instruction", "% of samples", "leading reasons (% of samples)"], instructions))


# ncu's per-instruction memory columns (SourceCounters): global sectors asked of L2, the fewest
# the bytes need, L1 tag lookups, shared-memory wavefronts (cp.async's stores) and their fewest.
SECTORS, IDEAL_SECTORS = "L2 Theoretical Sectors Global", "L2 Theoretical Sectors Global Ideal"
TAGS, WAVEFRONTS, IDEAL_WAVEFRONTS = "L1 Tag Requests Global", "L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal"


def count(value) -> float:
    """An ncu number as printed ("1,234", "" for none)."""
    return float(value.replace(",", "")) if value else 0.0


def sectors(text: str, top: int = 12) -> list:
    """ncu's source page (csv, SASS) -> per kernel (label, sectors asked of L2, their ideal, rows):
    the `top` instructions that ask for the most global sectors, each per warp request (an
    execution by one warp): sectors, ideal sectors, L1 tags, shared wavefronts and their ideal,
    and its share of the kernel's sectors. ncu counts them from the addresses, before L1: what
    L1 serves L2 does not see, but cp.async's L1-bypassing copies ask L2 for all of theirs (the
    eighty-fifth stop's down: 24 sectors a copy for 16 of bytes, in its L2 reads too)."""
    kernels = []
    for name, rows in kernel_pages(text):
        memory = [row for row in rows if count(row.get(SECTORS))]
        total, ideal = sum(count(row[SECTORS]) for row in memory), sum(count(row[IDEAL_SECTORS]) for row in memory)
        table = []
        for row in sorted(memory, key=lambda row: -count(row[SECTORS]))[:top]:
            requests = count(row["Instructions Executed"]) or 1
            table.append((row["Source"].strip()[:56], f"{requests:.0f}",
                          *(f"{count(row.get(column)) / requests:.1f}" for column in (SECTORS, IDEAL_SECTORS, TAGS, WAVEFRONTS, IDEAL_WAVEFRONTS)),
                          f"{count(row[SECTORS]) * 100 / (total or 1):.1f}"))
        kernels.append((kernel_label(name), total, ideal, table))
    return kernels


def print_sectors(kernels: list) -> None:
    for label, total, ideal, table in kernels:
        print(f"\n### {label}: {total / 1e6:.2f} M sectors asked of L2 ({total * 32 / 1e9:.3f} GB), "
              f"{ideal / 1e6:.2f} M ideal\n")
        print(markdown_table(["instruction", "requests", "sectors / request", "ideal", "L1 tags / request",
                              "shared wavefronts / request", "ideal", "% of sectors"], table))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="qwen3:2048", help="shape:tokens,... (shapes of benchmarks.prefill_ab)")
    parser.add_argument("--parts", default="gate_up,down", help=f"of {','.join(PARTS)}")
    parser.add_argument("--calls", type=int, default=1, help="launches of each part after its warm one")
    parser.add_argument("--stalls", metavar="CSV", help="print the stall tables of ncu's source page instead of running")
    parser.add_argument("--sectors", metavar="CSV", help="print the global-memory tables of ncu's source page instead of running")
    parser.add_argument("--top", type=int, default=12, help="rows per table")
    args = parser.parse_args(argv)
    if args.stalls or args.sectors:
        with open(args.stalls or args.sectors) as page:
            text = page.read()
        if args.stalls:
            print_stalls(stalls(text, args.top))
        else:
            print_sectors(sectors(text, args.top))
        return
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        raise SystemExit(f"unknown parts {sorted(unknown)} (of {', '.join(PARTS)})")
    if not mx.cuda.is_available():
        raise SystemExit("prefill_ncu launches the CUDA prefill kernels: run it on a CUDA GPU")
    run(args.cases.split(","), parts, args.calls)


if __name__ == "__main__":
    main()
