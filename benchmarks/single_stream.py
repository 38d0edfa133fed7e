"""One full-size MoE model's single-stream decode through mlx-lm's two callers, generate_step and
BatchGenerator (batch 1), stock and the patched variants alternating in one process, so that the
host's drift between calls (docs/benchmarks.md) shows as the spread between repeated rows
instead of as a difference between variants.

    python3 -m benchmarks.single_stream                        # qwen3_moe
    python3 -m benchmarks.single_stream --model mixtral --profile
    python3 -m benchmarks.single_stream --smoke                # tiny config, CPU

Variants: stock; patched (the defaults); patched with the routing in its own launch
(MLX_MOE_FIX_CUDA_ROUTED_DECODE=0); patched without compiled decode steps
(MLX_MOE_FIX_COMPILED_DECODE=0); then stock and patched again. Each row: the best of --repeats
runs after a warm-up (tok/s over --tokens tokens after the first), the worst in brackets.
--profile adds a cProfile of one BatchGenerator run per mode (the functions with the most own
time).
"""

import argparse
import cProfile
import io
import pstats
import types

import mlx.core as mx
import numpy as np

import mlx_moe_fix
from mlx_moe_fix.kernels.moe_routed_decode import CUDA_KERNEL_SWITCH as ROUTED_SWITCH
from mlx_moe_fix.patches.compiled import SWITCH as COMPILED_SWITCH

from . import models
from .decode_split import switched


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=[m for m in models.MOE_MODELS if m not in models.NO_BATCHED_DECODE],
                        default="qwen3_moe")
    parser.add_argument("--prompt", type=int, default=256, help="tokens in the cache before decoding")
    parser.add_argument("--tokens", type=int, default=32, help="tokens timed per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny config, few tokens (CPU)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompt, args.tokens, args.repeats = 12, 4, 1

    spec = models.model_specs(args.smoke, 4)[args.model]
    model = models.build_model(spec)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, spec.config["vocab_size"], args.prompt).tolist()]
    decode_prompt = mx.array(prompts[0])
    # models.time_decode times the tokens after the first; the BatchGenerator run, its steps after the first
    settings = types.SimpleNamespace(prefill_step_size=2048, batch_tokens=args.tokens, decode_tokens=args.tokens + 1)
    mlx_moe_fix.apply()
    caches = models.build_prompt_caches(model, prompts, settings)

    def rates(run) -> str:
        measured = [args.tokens / run() for _ in range(args.repeats + 1)][1:]
        return f"{max(measured):.1f} ({min(measured):.1f})"

    def row(label: str, patched: bool) -> str:
        (mlx_moe_fix.apply if patched else mlx_moe_fix.revert)()
        batched = rates(lambda: models.time_batch_decode(model, prompts, caches, 1, settings))
        single = rates(lambda: models.time_decode(model, decode_prompt, settings)[0])
        return f"| {label} | {batched} | {single} |"

    rows = [row("stock", False), row("patched", True)]
    with switched(ROUTED_SWITCH, "0"):
        rows.append(row("patched, routing in its own launch", True))
    with switched(COMPILED_SWITCH, "0"):
        rows.append(row("patched, decode steps not compiled", True))
    rows += [row("stock again", False), row("patched again", True)]
    mlx_moe_fix.revert()

    print(f"{args.model}, {args.prompt}-token cache, {args.tokens} tokens, MLX {mx.__version__}, {mx.default_device()}; "
          f"tok/s, best of {args.repeats} (worst)")
    print("| variant | BatchGenerator, batch 1 | generate_step |\n|---|---|---|")
    print("\n".join(rows))
    if args.profile:
        for label, patched in (("patched", True), ("stock", False)):
            (mlx_moe_fix.apply if patched else mlx_moe_fix.revert)()
            profile = cProfile.Profile()
            profile.enable()
            seconds = models.time_batch_decode(model, prompts, caches, 1, settings)
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
            print(f"\n{label}, BatchGenerator batch 1 under cProfile: {args.tokens / seconds:.1f} tok/s\n{text.getvalue()}")
        mlx_moe_fix.revert()


if __name__ == "__main__":
    main()
