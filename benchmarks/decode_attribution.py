"""Where a decode token's time goes, by leaving stages out (issue 5's attribution).

    python3 -m benchmarks.decode_attribution                        # qwen3_moe and mixtral, full size
    python3 -m benchmarks.decode_attribution --models qwen3_moe --decode-tokens 64

For each MoE model (full-size random 4-bit, as benchmarks/models.py builds them) and its dense
equivalent, greedy decode is timed with every layer's MLP block whole and with stages left out:

- MoE model, `full`: stock; `patched`: with mlx_moe_fix applied (whatever its switches select);
  `no experts`: the SwitchGLUs return their input broadcast over the k experts (no kernel), so
  routing and the weighted combine still run; `no MoE`: each MoE block returns its input
  (attention, norms, embedding and head only).
- dense equivalent, `full`, and `no MLP`: each MLP returns its input.

Differences per layer then give the experts' time (full - no experts), routing + combine
(no experts - no MoE), the dense MLP's (full - no MLP), and the rest, which should agree between
the two models (same attention). Times are the median of `--repeats` runs of `--decode-tokens`
tokens after a `--decode-prompt`-token prompt, after one warm-up run per variant (each variant
has its own graph for MLX to compile). A variant's tokens are not meaningful: only its time.
"""

import argparse
import contextlib
import statistics
from typing import Callable, Dict, Iterator, List

import mlx.core as mx

import mlx_moe_fix

from .models import MOE_MODELS, build_model, set_mode, start_run, time_decode
from .timing import log, markdown_table, write_json


def identity(self, x, *args, **kwargs):
    return x


def experts_skipped(self, x, indices, *args, **kwargs):
    """A SwitchGLU that returns its input for each of a token's k experts, as a view."""
    return mx.broadcast_to(mx.expand_dims(x, -2), (*indices.shape, x.shape[-1]))


@contextlib.contextmanager
def replaced_calls(classes, replacement: Callable, around: bool = False) -> Iterator[None]:
    """`replacement` as the __call__ of each class in `classes` within the block; with `around`,
    `replacement(the class's own call)` is. A class that inherits its call inherits it again after."""
    saved = [(cls, cls.__dict__.get("__call__"), cls.__call__) for cls in classes]
    try:
        for cls, _, call in saved:
            cls.__call__ = replacement(call) if around else replacement
        yield
    finally:
        for cls, own, _ in saved:
            if own is None:
                del cls.__call__
            else:
                cls.__call__ = own


def moe_block_classes(model) -> set:
    """The classes of the modules that hold the experts (upstream names them `switch_mlp`)."""
    return {type(m) for _, m in model.named_modules() if hasattr(m, "switch_mlp")}


def switch_classes(model) -> set:
    return {type(m.switch_mlp) for _, m in model.named_modules() if hasattr(m, "switch_mlp")}


def mlp_classes(model) -> set:
    """The classes of a dense model's MLPs (mlx-lm's `mlp`; DeepSeek-V4's decoder block names it `ffn`)."""
    return {type(layer["mlp"] if "mlp" in layer else layer["ffn"]) for layer in model.layers}


def variants(model, moe: bool) -> Dict[str, Callable[[], contextlib.AbstractContextManager]]:
    """name -> a context manager that sets the variant up (the model runs stock outside them)."""
    if not moe:
        return {"full": contextlib.nullcontext, "no MLP": lambda: replaced_calls(mlp_classes(model), identity)}
    return {
        "full": contextlib.nullcontext,
        "patched": mlx_moe_fix.patched,
        "no experts": lambda: replaced_calls(switch_classes(model), experts_skipped),
        "no MoE": lambda: replaced_calls(moe_block_classes(model), identity),
    }


def time_variants(model, moe: bool, prompt: mx.array, args) -> Dict[str, float]:
    """Median seconds per decoded token of each variant."""
    seconds = {}
    for name, setup in variants(model, moe).items():
        set_mode("stock")
        with setup():
            time_decode(model, prompt, args)  # warm-up: this variant's graph and shapes
            runs = [time_decode(model, prompt, args)[0] for _ in range(args.repeats)]
        seconds[name] = statistics.median(runs) / (args.decode_tokens - 1)
        log(f"[attribution] {name}: {1 / seconds[name]:.1f} tok/s")
    set_mode("stock")
    return seconds


def attribution_rows(name: str, dense_name: str, moe: Dict[str, float], dense: Dict[str, float],
                     layers: int) -> List[List[str]]:
    def us(seconds):
        return f"{seconds / layers * 1e6:.0f}"

    return [
        [name, "token (per layer)", us(moe["full"]), dense_name, us(dense["full"])],
        [name, "patched token (per layer)", us(moe["patched"]), "", ""],
        [name, "experts", us(moe["full"] - moe["no experts"]), "dense MLP", us(dense["full"] - dense["no MLP"])],
        [name, "routing + combine", us(moe["no experts"] - moe["no MoE"]), "", ""],
        [name, "rest (attention, norms, head)", us(moe["no MoE"]), "rest", us(dense["no MLP"])],
    ]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen3_moe,mixtral", help="MoE models of benchmarks/models.py")
    p.add_argument("--decode-prompt", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--deepseek-layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the seconds per token of every variant here")
    p.add_argument("--smoke", action="store_true", help="tiny configs, few tokens (CPU check of the script)")
    args = p.parse_args(argv)
    if args.smoke:
        args.decode_prompt, args.decode_tokens, args.repeats = 8, 4, 1
    args.models = args.models.split(",")
    unknown = set(args.models) - set(MOE_MODELS)
    if unknown:
        p.error(f"unknown models {sorted(unknown)}; choose from {MOE_MODELS}")
    return args


def main(argv=None):
    args = parse_args(argv)
    rng, env, specs = start_run(args, "attribution")
    results, rows = {}, []
    for name in args.models:
        spec = specs[name]
        prompt = mx.array(rng.integers(0, spec.config["vocab_size"], size=args.decode_prompt).tolist())
        timed = {}
        for model_name, moe in ((name, True), (spec.dense, False)):
            log(f"[attribution] building {model_name}")
            model = build_model(specs[model_name])
            timed[model_name] = time_variants(model, moe, prompt, args)
            del model
            mx.clear_cache()
        results[name] = timed
        rows += attribution_rows(name, spec.dense, timed[name], timed[spec.dense], spec.config["num_hidden_layers"])
    table = markdown_table(["model", "us per layer of", "MoE", "dense equivalent", "dense"], rows)
    if args.json:
        write_json(args.json, {"env": env, "args": vars(args), "seconds_per_token": results})
    print(table)
    return results


if __name__ == "__main__":
    main()
