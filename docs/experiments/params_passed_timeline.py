"""An A/B prepared in the thirty-fourth session and run in the thirty-fifth (docs/benchmarks.md,
thirty-fifth session, item 2: the router-inside launch 26.3 µs a layer both ways, so the source
constants did not move it; the machines did): `benchmarks.gpu_timeline` with the CUDA
decode launches' params passed as an input array (their layout before 1f7c964 declared them in the
kernels' source), to tell whether the source constants or the machine moved Qwen3's router-inside
launch from 24.7 (thirty-second session) to 26.3 µs a layer (thirty-third). Run it between two
default runs on one machine:
    source .mlx-cuda/setup.sh && source scripts/ptx-cache.sh
    python3 -m benchmarks.gpu_timeline --parts blocks --routers --shapes qwen3
    python3 docs/experiments/params_passed_timeline.py --parts blocks --routers --shapes qwen3
    python3 -m benchmarks.gpu_timeline --parts blocks --routers --shapes qwen3"""
import runpy
import sys

import mlx_moe_fix.kernels.launch as launch

launch.SOURCE_CONSTANTS = ()  # read by launch.source_constants at each launch plan
sys.argv = ["gpu_timeline", *sys.argv[1:]]
runpy.run_module("benchmarks.gpu_timeline", run_name="__main__")
