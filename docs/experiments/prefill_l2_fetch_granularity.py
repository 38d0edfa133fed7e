"""The prefill GEMMs with the L2 cache's DRAM fetch granularity hinted to 32, 64 or 128 bytes
(CUDA's CU_LIMIT_MAX_L2_FETCH_GRANULARITY on MLX's context), in one process, rounds alternating.

Why: under 64-row tiles (DeepSeek-V3 at a few hundred tokens) the grouped GEMM streams every
expert's weights, and each block's k-step copies 32 bytes of each of its 128 or 256 weight rows
(3584 bytes apart at K 7168): 32-byte pieces of many DRAM rows. ncu read its DRAM at 52% of peak
and the GEMM without its weight copies 1.38x faster, while a deeper pipeline (more bytes in
flight) and scale windows (fewer L2 requests) changed nothing (docs/benchmarks.md, seventy-eighth
stop item 6, seventy-ninth stop items 1 and 4). If the pieces' size is what holds DRAM back, a
128-byte fetch (four k-steps of a row at once) moves the rate; the hint may also be ignored (the
driver "can ignore or clamp" it), which `cuCtxGetLimit` after each set shows.

    source .mlx-cuda/setup.sh && python3 docs/experiments/prefill_l2_fetch_granularity.py \\
        --cases dsv3:512,dsv3:256,mixtral:64,qwen3:2048 --parts gate_up,down,layer

GPU only (the CUDA driver, libcuda.so.1). Per case and part: TFLOP/s at each granularity (medians
over rounds) and the median per-round speed ratio of each against the driver's default.
"""

import argparse
import ctypes
import importlib
import statistics
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.prefill_ab import build_case, part_calls, part_flops  # noqa: E402
from benchmarks.switch_glu import experts_of  # noqa: E402
from benchmarks.timing import bench, fmt, markdown_table, repeated  # noqa: E402

CU_LIMIT_MAX_L2_FETCH_GRANULARITY = 0x05


class Driver:
    """The CUDA driver's limits on device 0's primary context, the one MLX's runtime uses."""

    def __init__(self):
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.context = ctypes.c_void_p()
        self.check(self.cuda.cuInit(0), "cuInit")
        self.check(self.cuda.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), 0), "cuDevicePrimaryCtxRetain")

    @staticmethod
    def check(status: int, call: str) -> None:
        if status != 0:
            raise SystemExit(f"{call} failed: CUresult {status}")

    def _in_context(self, call):
        self.check(self.cuda.cuCtxPushCurrent_v2(self.context), "cuCtxPushCurrent_v2")
        try:
            return call()
        finally:
            self.check(self.cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p())), "cuCtxPopCurrent_v2")

    def granularity(self) -> int:
        value = ctypes.c_size_t()
        self._in_context(lambda: self.check(self.cuda.cuCtxGetLimit(ctypes.byref(value), CU_LIMIT_MAX_L2_FETCH_GRANULARITY),
                                            "cuCtxGetLimit"))
        return value.value

    def set_granularity(self, value: int) -> int:
        """Sets the hint once the GPU is idle; returns what the driver then reports."""
        mx.synchronize()
        self._in_context(lambda: self.check(self.cuda.cuCtxSetLimit(CU_LIMIT_MAX_L2_FETCH_GRANULARITY, ctypes.c_size_t(value)),
                                            "cuCtxSetLimit"))
        return self.granularity()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="dsv3:512,dsv3:256,mixtral:64,qwen3:2048", help="prefill_ab's shape:tokens,...")
    parser.add_argument("--parts", default="gate_up,down,layer")
    parser.add_argument("--granularities", default="32,64,128", help="bytes, besides the driver's default")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--launches", type=int, default=4)
    args = parser.parse_args(argv)
    if not mx.cuda.is_available():
        raise SystemExit("needs MLX's CUDA backend")
    mx.eval(mx.zeros(1) + 1)  # MLX's context exists before the driver's limits are read
    driver = Driver()
    default = driver.granularity()
    settings = {"default": default, **{f"{g} B": int(g) for g in args.granularities.split(",")}}
    reported = {name: driver.set_granularity(value) for name, value in settings.items()}
    driver.set_granularity(default)
    print(f"L2 fetch granularity: driver default {default} B; reported after each set: " +
          ", ".join(f"{name} -> {value}" for name, value in reported.items()), flush=True)
    prefill = importlib.import_module("mlx_moe_fix.kernels.moe_prefill")  # the module; the package's name is its dispatcher
    rows = []
    for case in args.cases.split(","):
        shape, tokens = case.split(":")
        layer, x, indices, weights = build_case(shape, int(tokens))
        calls = part_calls(prefill, experts_of(layer), x, indices, weights)
        for part in args.parts.split(","):
            call = calls[part][0]
            times = {name: [] for name in settings}
            for r in range(args.rounds):
                for name in (list(settings) if r % 2 == 0 else list(reversed(settings))):
                    driver.set_granularity(settings[name])
                    times[name].append(bench(repeated(call, args.launches), 2, args.reps).median / args.launches)
            driver.set_granularity(default)
            flops = part_flops(part, shape, indices.size)
            cells = []
            for name in settings:
                ratios = [base / t for base, t in zip(times["default"], times[name])]
                cells.append(f"{fmt(flops / statistics.median(times[name]) / 1e12)} ({statistics.median(ratios):.3f}, "
                             f"{min(ratios):.3f}-{max(ratios):.3f})")
            rows.append([case, part, *cells])
            print(markdown_table(["case", "part", *settings], rows[-1:]), flush=True)
    print("\nTFLOP/s (median), in brackets the speed against the default (median and range over rounds):")
    print(markdown_table(["case", "part", *settings], rows))


if __name__ == "__main__":
    main()
