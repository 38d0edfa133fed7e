"""A prefill's time for the whole model: one forward of a full-size MoE model and of its dense
equivalent at each prompt length (no cache, as a prompt's first chunk), host graph building timed
apart from evaluation, whole and with the MoE block / MLP left out (each returning its input).
(benchmarks/prefill_split.py times one layer's stages.)

    python3 -m benchmarks.prefill_forward                            # qwen3_moe, 512 and 2048 tokens
    python3 -m benchmarks.prefill_forward --model mixtral --prompts 512
    python3 -m benchmarks.prefill_forward --smoke                    # tiny configs, CPU

Variants, in one process: the MoE model patched, its prefill calls compiled per shape (the
default: the timed calls are the third and later of their shape, replayed; patches/compiled.py);
patched with every call built in Python (MLX_MOE_FIX_COMPILED_PREFILL=0, as a prompt length's
first call is); patched with gate+up on the other GEMM (MLX_MOE_FIX_CUDA_PREFILL_WGMMA flipped);
stock (prompts up to --stock-max-prompt); the dense equivalent (benchmarks.models); both models
without their MoE block / MLP. Every variant runs once per round, --reps forwards, and the rounds repeat, so that
each ratio to the dense equivalent is taken between runs seconds apart (this host's speed drifts;
docs/benchmarks.md, tenth session); the first round starts each variant with two untimed forwards
at the same shape (MLX compiles its kernels per shape; the compiled variant traces by its second
call). A new length's first three calls (L + 1 tokens), build and eval, patched (in a model called
before: traced by its first MoE block and replayed by the others from the first call) and of the
dense equivalent, and the ratio of their first calls' totals, are printed last, with what each
first call added to MLX's PTX cache (kernels NVRTC compiled, by name) and to the CUDA driver's
compute cache (PTX the driver compiled for the GPU as MLX loaded it): run with MLX_PTX_CACHE_DIR
and CUDA_CACHE_PATH at empty folders to see everything a first call compiles. Build: the Python call that makes the lazy graph; eval: mx.eval of the logits; both the
median over rounds of each round's median. A model's total less its variant's without MoE block /
MLP is the blocks' share of the forward.
"""

import argparse
import contextlib
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlx_moe_fix
from mlx_moe_fix import env
from mlx_moe_fix.kernels.kernel_cache import ptx_cache_directory
from mlx_moe_fix.kernels.moe_prefill import WGMMA_SWITCH
from mlx_moe_fix.patches.compiled import PREFILL_COMPILE_SWITCH

from . import models
from .decode_attribution import identity, mlp_classes, moe_block_classes, replaced_calls
from .decode_split import split, switched
from .timing import markdown_table, write_json


def forward_split(model, prompt: mx.array, reps: int, warm_ups: int) -> tuple:
    """Median (build ms, eval ms) of `reps` forwards over `prompt`, after `warm_ups` untimed."""
    return tuple(seconds * 1e3 for seconds in split(lambda: model(prompt), reps, warm_ups))


def variants(moe, dense, stock_allowed: bool) -> dict:
    """label: (model, a context manager factory that sets the variant up)."""
    other_gemm = "0" if env.flag(WGMMA_SWITCH) else "1"
    out = {
        "MoE, patched (prefill compiled per shape)": (moe, mlx_moe_fix.patched),
        "MoE, patched, built in Python": (moe, lambda: _built_in_python()),
        # gate+up on the other GEMM (moe_prefill.gemm_kernel)
        f"MoE, patched, {WGMMA_SWITCH}={other_gemm}": (moe, lambda: _patched_with(WGMMA_SWITCH, other_gemm)),
    }
    if stock_allowed:
        out["MoE, stock"] = (moe, contextlib.nullcontext)
    out["dense equivalent"] = (dense, contextlib.nullcontext)
    out["MoE, patched, without MoE blocks"] = (moe, lambda: _without(mlx_moe_fix.patched(), moe_block_classes(moe)))
    out["dense equivalent, without MLPs"] = (dense, lambda: _without(contextlib.nullcontext(), mlp_classes(dense)))
    return out


@contextlib.contextmanager
def _patched_with(switch: str, value: str):
    with switched(switch, value), mlx_moe_fix.patched():
        yield


def _built_in_python():
    return _patched_with(PREFILL_COMPILE_SWITCH, "0")


def kernel_caches() -> dict:
    """label: folder of the caches a first call may add to: MLX's PTX cache (jit_module.cpp's
    default when MLX_PTX_CACHE_DIR is unset) and the CUDA driver's compute cache (its default when
    CUDA_CACHE_PATH is unset)."""
    return {"MLX PTX": ptx_cache_directory(),
            "driver": Path(os.environ.get("CUDA_CACHE_PATH") or Path.home() / ".nv" / "ComputeCache")}


def cache_files(folder: Path) -> set:
    return {p.relative_to(folder) for p in folder.rglob("*") if p.is_file()} if folder.is_dir() else set()


def cache_snapshot() -> dict:
    """label: the files in each of kernel_caches' folders now."""
    return {label: cache_files(folder) for label, folder in kernel_caches().items()}


def cache_additions(before: dict, after: dict) -> str:
    """What a call added to each cache: MLX's kernels by name (one .ptx each), the driver's as a count."""
    added = {label: after[label] - before[label] for label in before}
    kernels = sorted(p.stem for p in added["MLX PTX"] if p.suffix == ".ptx")
    return f"{len(kernels)} PTX compiled{' (' + ', '.join(kernels) + ')' if kernels else ''}, {len(added['driver'])} driver cache files"


def first_calls(model, prompt: mx.array, calls: int = 3) -> tuple:
    """(build ms, eval ms) of the first `calls` forwards at the shape of `prompt`, and what the first
    added to the kernel caches (cache_additions)."""
    times = []
    before = cache_snapshot()
    for call in range(calls):
        start = time.perf_counter()
        logits = model(prompt)
        built = time.perf_counter()
        mx.eval(logits)
        times.append(((built - start) * 1e3, (time.perf_counter() - built) * 1e3))
        del logits
        if call == 0:
            added = cache_additions(before, cache_snapshot())
    return times, added


@contextlib.contextmanager
def _without(mode, classes):
    with mode, replaced_calls(classes, identity):
        yield


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=models.MOE_MODELS, default="qwen3_moe")
    parser.add_argument("--prompts", default="512,2048", help="prompt lengths, comma-separated")
    parser.add_argument("--stock-max-prompt", type=int, default=512, help="longest prompt stock is timed at")
    parser.add_argument("--deepseek-layers", type=int, default=4, help="layers of deepseek_v3, inkling, deepseek_v4")
    parser.add_argument("--reps", type=int, default=5, help="forwards per variant and round")
    parser.add_argument("--rounds", type=int, default=3, help="every variant once per round (the host's speed drifts)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--smoke", action="store_true", help="tiny configs (CPU)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.reps, args.rounds = "40", 1, 2

    specs = models.model_specs(args.smoke, args.deepseek_layers)
    spec = specs[args.model]
    moe, dense = models.build_model(spec), models.build_model(specs[spec.dense])
    rng = np.random.default_rng(0)
    mlx_moe_fix.revert()
    rows, first_builds, first_additions = [], [], []
    for length in (int(n) for n in args.prompts.split(",")):
        prompt = mx.array(rng.integers(0, spec.config["vocab_size"], (1, length)))
        chosen = variants(moe, dense, length <= args.stock_max_prompt)
        rounds = {label: [] for label in chosen}  # label: [(build, eval) per round]
        for round_index in range(args.rounds):
            for label, (model, setup) in chosen.items():
                with setup():
                    rounds[label].append(forward_split(model, prompt, args.reps, 2 if round_index == 0 else 0))
        dense_totals = [sum(run) for run in rounds["dense equivalent"]]
        for label, runs in rounds.items():
            ratios = [d / sum(run) for d, run in zip(dense_totals, runs)]
            build, evaluate = (statistics.median(run[i] for run in runs) for i in (0, 1))
            rows.append([length, label, f"{build:.2f}", f"{evaluate:.2f}", f"{build + evaluate:.2f}",
                         " / ".join(f"{q:.3f}" for q in ratios), f"{statistics.median(ratios):.3f}"])
        # Two new lengths, each model first at one: the second model at a length finds the kernels
        # the first loaded for it (the attention's, the same in both models).
        for offset, patched_first in ((1, True), (2, False)):
            new_length = mx.array(rng.integers(0, spec.config["vocab_size"], (1, length + offset)))
            calls = {}
            for patched in (patched_first, not patched_first):
                with mlx_moe_fix.patched() if patched else contextlib.nullcontext():
                    calls[patched], added = first_calls(moe if patched else dense, new_length)
                first_additions.append(f"{length + offset} tokens, {'MoE, patched' if patched else 'dense equivalent'}: {added}")
            versus = sum(calls[False][0]) / sum(calls[True][0])
            for label, patched in (("MoE, patched", True), ("dense equivalent", False)):
                order = "first" if patched == patched_first else "second"
                first_builds.append([length + offset, label, order] + [f"{b:.2f} / {e:.2f}" for b, e in calls[patched]]
                                    + [f"{versus:.3f}"])
    print(f"{args.model} and {spec.dense}: one forward (no cache), ms, medians over {args.rounds} rounds of "
          f"{args.reps} forwards per variant; MLX {mx.__version__}, {mx.default_device()}")
    print(markdown_table(["tokens", "variant", "build", "eval", "total", "dense total / total, per round", "median"],
                         rows))
    print(f"\na new prompt length's first calls, build / eval ms, {args.model} and {spec.dense} (one run each; "
          "the 1st call's eval includes what MLX compiles or loads for the shape, which the model run second "
          "at that length may find loaded):")
    print(markdown_table(["tokens", "model", "at this length", "1st call", "2nd", "3rd", "dense / patched, 1st call"],
                         first_builds))
    print("added to the kernel caches by each 1st call, in order (" +
          ", ".join(f"{label}: {folder}" for label, folder in kernel_caches().items()) + "):")
    print("\n".join(first_additions))
    with mlx_moe_fix.patched():
        state = mlx_moe_fix.status()["compiled_prefill_shapes"]
    print(f"prefill compiled per shape, patched: {'on' if state['on'] else 'off'} ({state['reason']})")
    if args.json:
        write_json(args.json, {"model": args.model, "rows": rows, "first_builds": first_builds,
                               "first_additions": first_additions})


if __name__ == "__main__":
    main()
