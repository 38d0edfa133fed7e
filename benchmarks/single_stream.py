"""One full-size MoE model's single-stream decode against its dense equivalent, with every variant
measured once per round and the rounds repeated, all in one process: this host's speed drifts
between calls and within one (docs/benchmarks.md, ninth session), so a ratio is taken within a
round, where the variants ran seconds apart, and the rounds show its spread.

    python3 -m benchmarks.single_stream                        # qwen3_moe, 3 rounds
    python3 -m benchmarks.single_stream --model mixtral --profile
    python3 -m benchmarks.single_stream --model deepseek_v4 --deepseek-layers 6
    python3 -m benchmarks.single_stream --smoke                # tiny configs, CPU

Variants: the MoE model stock; patched (the defaults); patched with the routing in its own launch
(MLX_MOE_FIX_CUDA_ROUTED_DECODE=0; mlx-lm's routed blocks only); patched without compiled decode steps
(MLX_MOE_FIX_COMPILED_DECODE=0); its dense equivalent (benchmarks.models). Callers: mlx-lm's
generate_step, and BatchGenerator at batch 1 (not for the mlx-vlm families, whose caches it does
not take). Each measurement: tok/s over --tokens tokens after the first, from a --prompt-token
prompt (BatchGenerator: a prompt cache built once), after one warm-up run in the first round.
--profile adds a cProfile of one BatchGenerator run per mode (the functions with the most own
time).
"""

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import types

import mlx.core as mx

import mlx_moe_fix
from mlx_moe_fix.kernels.moe_routed_decode import CUDA_KERNEL_SWITCH as ROUTED_SWITCH
from mlx_moe_fix.patches.compiled import SWITCH as COMPILED_SWITCH

from . import models
from .decode_split import switched

# label: (the dense equivalent's model rather than the MoE one, patched, switches set to "0")
VARIANTS = {
    "stock": (False, False, ()),
    "patched": (False, True, ()),
    "patched, routing in its own launch": (False, True, (ROUTED_SWITCH,)),
    "patched, decode steps not compiled": (False, True, (COMPILED_SWITCH,)),
    "dense equivalent": (True, False, ()),
}


ROUTED_BLOCKS = ("qwen3_moe", "mixtral", "gpt_oss")
CALLERS = ("generate_step", "BatchGenerator")


def measure(run, variant: tuple) -> float:
    """`run()` (seconds for the timed tokens) in `variant`, then stock again."""
    _, patched, off = variant
    with contextlib.ExitStack() as stack:
        for name in off:
            stack.enter_context(switched(name, "0"))
        (mlx_moe_fix.apply if patched else mlx_moe_fix.revert)()
        try:
            return run()
        finally:
            mlx_moe_fix.revert()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    models.add_decode_pair_arguments(parser)
    parser.add_argument("--tokens", type=int, default=32, help="tokens timed per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=";".join(VARIANTS), help="labels of VARIANTS to run, separated by ';' ('dense equivalent' always runs)")
    parser.add_argument("--callers", default=",".join(CALLERS), help=f"comma-separated: {', '.join(CALLERS)}")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny configs, few tokens (CPU)")
    args = parser.parse_args(argv)
    chosen = set(args.variants.split(";")) | {"dense equivalent"}
    unknown = chosen - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    chosen_callers = set(args.callers.split(","))
    if chosen_callers - set(CALLERS):
        parser.error(f"unknown callers {sorted(chosen_callers - set(CALLERS))}; choose from {list(CALLERS)}")
    if args.smoke:
        args.prompt, args.tokens, args.rounds = 12, 4, 2

    _, built, prompt = models.build_decode_pair(args)
    # models.time_decode times the tokens after the first; a BatchGenerator run, its steps after the first
    settings = types.SimpleNamespace(prefill_step_size=2048, batch_tokens=args.tokens, decode_tokens=args.tokens + 1)
    batched = args.model not in models.NO_BATCHED_DECODE and "BatchGenerator" in chosen_callers
    caches = {dense: models.build_prompt_caches(model, [prompt], settings) for dense, model in built.items()} if batched else {}

    callers = {}
    if "generate_step" in chosen_callers:
        callers["generate_step"] = lambda model, dense: models.time_decode(model, mx.array(prompt), settings)[0]
    if batched:
        callers["BatchGenerator, batch 1"] = lambda model, dense: models.time_batch_decode(model, [prompt], caches[dense], 1, settings)
    # the routing in its own launch only where the routing can be inside (moe_blocks.routed_block)
    variants = {label: v for label, v in VARIANTS.items()
                if label in chosen and (ROUTED_SWITCH not in v[2] or args.model in ROUTED_BLOCKS)}
    rates = {(caller, label): [] for caller in callers for label in variants}
    for round_index in range(args.rounds):
        for caller, run in callers.items():
            for label, variant in variants.items():
                model = built[variant[0]]
                timed = lambda: run(model, variant[0])  # noqa: E731
                if round_index == 0:
                    measure(timed, variant)  # warm-up at exactly the timed shapes
                rates[caller, label].append(args.tokens / measure(timed, variant))

    print(f"{args.model} and its dense equivalent, {args.prompt}-token prompt, {args.tokens} tokens, "
          f"{args.rounds} rounds, MLX {mx.__version__}, {mx.default_device()}")
    for caller in callers:
        print(f"\n{caller}: tok/s per round; / dense: the ratio within each round, and its median\n"
              "| variant | tok/s | / dense | median / dense |\n|---|---|---|---|")
        dense = rates[caller, "dense equivalent"]
        for label in variants:
            ratios = [r / d for r, d in zip(rates[caller, label], dense)]
            print(f"| {label} | {' / '.join(f'{r:.1f}' for r in rates[caller, label])} | "
                  f"{' / '.join(f'{q:.3f}' for q in ratios)} | {statistics.median(ratios):.3f} |")
    if args.profile and batched:
        for label in ("patched", "stock"):
            variant = VARIANTS[label]

            def profiled():
                profile = cProfile.Profile()
                profile.enable()
                seconds = callers["BatchGenerator, batch 1"](built[False], False)
                profile.disable()
                text = io.StringIO()
                pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
                print(f"\n{label}, BatchGenerator batch 1 under cProfile: {args.tokens / seconds:.1f} tok/s\n{text.getvalue()}")
                return seconds

            measure(profiled, variant)


if __name__ == "__main__":
    main()
