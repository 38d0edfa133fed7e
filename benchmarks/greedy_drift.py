"""Where a patched model's logits leave stock's, step by step, and why: for a zoo model on the
GPU, each kernel switch on alone and both together, the patched model is fed stock's greedy
tokens (teacher forcing) and each step's logits are compared with stock's. Beside the error:
stock's top-2 margin, and whether a MoE layer routed a token to other experts than stock did
(a router near-tie flips an expert and moves the logits far more than any rounding).

    python3 -m benchmarks.greedy_drift --family mixtral --bits 4
"""

import argparse
import os
import time

import mlx.core as mx

import mlx_moe_fix
from mlx_moe_fix import zoo

from .timing import markdown_table, relative_error

SWITCHES = ("MLX_MOE_FIX_CUDA_DECODE", "MLX_MOE_FIX_CUDA_PREFILL")
# "stock again": a second unpatched run, stock's own run-to-run spread on this backend.
CONFIGS = {"stock again": None, "references": (), "decode kernel": SWITCHES[:1], "prefill kernel": SWITCHES[1:], "both kernels": SWITCHES}


def run(model, prompt, stock_tokens):
    """Stock's own greedy stream when stock_tokens is None, else teacher forcing on it."""
    with zoo.recording_routes(model) as routes:
        if stock_tokens is None:
            tokens, logits = zoo.greedy_decode(model, prompt, 32)
        else:
            tokens, logits = zoo.forced_decode(model, prompt, stock_tokens)
    return tokens, logits, routes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="mixtral", choices=zoo.FAMILIES)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    model = zoo.build(args.family, args.bits, dtype=mx.bfloat16)
    prompt = zoo.prompt_for(args.family)
    stock, stock_logits, stock_routes = run(model, prompt, None)
    # Progress as it goes: a first run on a fresh GPU machine can spend minutes compiling.
    print(f"stock: {len(stock)} tokens after {time.perf_counter() - started:.0f} s", flush=True)
    columns = ["step", "stock top-2 margin"]
    top_two = mx.sort(stock_logits, axis=-1)[:, -2:].tolist()
    table = [[step, f"{top[1] - top[0]:.3g}"] for step, top in enumerate(top_two)]
    for name in args.configs.split(","):
        if CONFIGS[name] is None:
            choices, logits, routes = run(model, prompt, stock)
        else:
            for switch in SWITCHES:
                os.environ[switch] = "1" if switch in CONFIGS[name] else "0"
            with mlx_moe_fix.patched():
                choices, logits, routes = run(model, prompt, stock)
        columns += [f"{name}: rel err", "rerouted", "same token"]
        rerouted = zoo.rerouted_steps(routes, stock_routes, len(stock))
        errors = [relative_error(logits[step], stock_logits[step]) for step in range(len(stock))]
        for step, error in enumerate(errors):
            table[step] += [f"{error:.2e}", rerouted[step], choices[step] == stock[step]]
        worst = max(range(len(errors)), key=errors.__getitem__)
        print(f"{name}: largest logits error {errors[worst]:.2e} at step {worst}; rerouted steps "
              f"{[i for i, r in enumerate(rerouted) if r]}; other tokens at "
              f"{[i for i, (c, t) in enumerate(zip(choices, stock)) if c != t]}; "
              f"{time.perf_counter() - started:.0f} s", flush=True)
    print(markdown_table(columns, table))


if __name__ == "__main__":
    main()
