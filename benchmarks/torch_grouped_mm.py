"""torch._grouped_mm bf16 timings for the optional column of benchmarks/kernels.py.

kernels.py runs this in a process of its own, with the cases as JSON on stdin:

    echo '[{"key": "qwen3:2048", "hidden": 2048, "ffn": 768, "counts": [...],
            "warmup": 3, "reps": 20, "max_seconds": 2.0}]' | python3 -m benchmarks.torch_grouped_mm

so that torch's CUDA libraries never share a process with MLX's, and a torch that is missing,
has no CUDA or no `_grouped_mm`, refuses a shape or crashes only empties that column. It
imports neither MLX nor the rest of this package. Each case multiplies rows already sorted by
expert (counts[e] rows for expert e) [rows, hidden] by [E, hidden, ffn] bf16 expert weights,
timed with CUDA events; prints one JSON line:
{"torch": version, "results": {key: {"median_s", "min_s", "max_s", "reps"} or {"error"}}},
or {"error": why} when there is no usable torch.
"""

import itertools
import json
import statistics
import sys


def time_case(torch, case):
    counts = case["counts"]
    a = torch.randn(sum(counts), case["hidden"], dtype=torch.bfloat16, device="cuda")
    # [E, ffn, hidden] storage seen as [E, hidden, ffn]: the column-major B the grouped GEMM
    # takes without a copy, and the [out, in] layout checkpoints store.
    b = torch.randn(
        len(counts), case["ffn"], case["hidden"], dtype=torch.bfloat16, device="cuda"
    ).transpose(-2, -1)
    offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device="cuda")

    for _ in range(max(1, case["warmup"])):
        torch._grouped_mm(a, b, offs=offs)
    torch.cuda.synchronize()
    times = []
    for _ in range(max(1, case["reps"])):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        torch._grouped_mm(a, b, offs=offs)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
        if sum(times) > case["max_seconds"] and len(times) >= 3:
            break
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "reps": len(times),
    }


def usable_torch():
    """(torch, None) or (None, why not)."""
    try:
        import torch
    except Exception as e:
        return None, f"torch does not import: {e!r}"
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA GPU"
    if not hasattr(torch, "_grouped_mm"):
        return None, f"torch {torch.__version__} has no _grouped_mm"
    return torch, None


def main() -> None:
    cases = json.load(sys.stdin)
    torch, why_not = usable_torch()
    if torch is None:
        print(json.dumps({"error": why_not}))
        return
    results = {}
    for case in cases:
        try:
            results[case["key"]] = time_case(torch, case)
        except Exception as e:  # an unsupported shape: that cell only
            results[case["key"]] = {"error": repr(e)}
        torch.cuda.empty_cache()
    print(json.dumps({"torch": torch.__version__, "results": results}))


if __name__ == "__main__":
    main()
