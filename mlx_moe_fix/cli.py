"""`mlx-moe-fix status` and `mlx-moe-fix demo`."""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx

import mlx_moe_fix
from mlx_moe_fix.patches import no_kernel_reason


def markdown_table(headers: list, rows: list) -> str:
    """A markdown table with its columns padded to line up in a terminal."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, r)]

    def line(values):
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"

    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def target_reason(reason: str, status: dict) -> str:
    """A target's reason, the reason apply() patched nothing said once above the tables."""
    return "the reason above" if reason and reason == status["why_not_applied"] else reason


def show_status(as_json: bool) -> int:
    status = mlx_moe_fix.status()
    if as_json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"applied: {status['applied']}   backend: {status['backend']}   phases: {status['phases']}")
    if status["why_not_applied"]:
        print(f"not applied: {status['why_not_applied']}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in status["versions"].items()))
    print()
    print(markdown_table(["op", "runs", "why"], [[k, v["path"], v["reason"]] for k, v in status["ops"].items()]))
    for name in ("compiled_decode_steps", "compiled_prefill_shapes"):
        steps = status[name]
        print(f"{name.replace('_', ' ')}: {'on' if steps['on'] else 'off'} ({steps['reason']})")
    gemm = status["prefill_gemm"]
    print(f"prefill GEMMs (gate+up, down): {gemm['gemm'] or '-'} ({gemm['reason']})")
    inside = status["routed_decode_router_inside"]
    print(f"router's matmul inside the routed decode's gate+up launch: {'on' if inside['on'] else 'off'} ({inside['reason']})")
    cache = status["cuda_kernel_cache"]
    print(f"CUDA kernels' compiled code kept in MLX's PTX cache: {'on' if cache['on'] else 'off'} ({cache['reason']})")
    print()
    print(markdown_table(["target", "state", "why"], [[t["target"], t["state"], target_reason(t["reason"], status)]
                                                      for t in status["targets"]]))
    print()
    print("activations recognised: " + ", ".join(status["activations"]))
    return 0


def timed_generation(model, prompt: list, new_tokens: int, repeats: int) -> dict:
    """Greedy generation, prefill and decode timed apart: the best of `repeats` runs after two
    warm-ups at the same shapes (MLX compiles kernels per shape, and a patched block traces its
    compiled graph at a shape's second call: with one warm-up the first timed prefill took that
    trace: 10 and 1517 against 26278-35924 tok/s stock on the H200, docs/benchmarks.md forty-eighth
    session item 4)."""
    from .zoo import greedy_decode_timed

    for _ in range(2):
        greedy_decode_timed(model, prompt, new_tokens)
    runs = [greedy_decode_timed(model, prompt, new_tokens) for _ in range(repeats)]
    return {
        "tokens": runs[0][0],
        "prefill_tok_s": len(prompt) / min(r[1] for r in runs),
        "decode_tok_s": (new_tokens - 1) / min(r[2] for r in runs) if new_tokens > 1 else float("nan"),
    }


def demo_model(family: str, bits: int, prompt_tokens: int) -> tuple:
    """(model, prompt, what it is) of a zoo family."""
    from .zoo import build, prompt_for

    started = time.perf_counter()
    model = build(family, bits)
    return model, prompt_for(family, prompt_tokens), (
        f"{family} ({bits}-bit, random weights, built in {time.perf_counter() - started:.1f} s)")


def checkpoint_model(path: str, prompt_tokens: int) -> tuple:
    """(model, prompt, what it is) of an MLX checkpoint (a folder, or a Hugging Face repo fetched
    into the Hub's cache): mlx-lm's model where mlx-lm builds it, else mlx-vlm's language model. The
    prompt is token ids spread over its vocab: the demo checks parity and speed, not text."""
    from pathlib import Path

    from .zoo import has_expert_layers, spread_tokens

    started = time.perf_counter()
    folder = Path(path)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.py"]))
    try:
        from mlx_lm.utils import load_model

        model, config = load_model(folder)
        library = "mlx-lm"
    except Exception as mlx_lm_error:  # any failure of mlx-lm's is a reason to try mlx-vlm's
        try:
            from mlx_vlm.utils import load_config, load_model as load_vlm_model
        except ImportError:
            raise SystemExit(f"mlx-lm cannot load {path} ({first_line(mlx_lm_error)}) and mlx-vlm is not installed") from None
        try:
            model, config, library = load_vlm_model(folder).language_model, load_config(folder), "mlx-vlm"
        except Exception as mlx_vlm_error:
            raise SystemExit(f"neither mlx-lm ({first_line(mlx_lm_error)}) nor mlx-vlm ({first_line(mlx_vlm_error)}) "
                             f"can load {path}") from None
    if not has_expert_layers(model):
        raise SystemExit(f"{path} ({library}'s {config.get('model_type')}) has no expert (switch) layers: "
                         "nothing for the package to patch")
    # a VLM's outer config may carry its class's default vocab_size, not its language model's
    vocab_size = config.get("text_config", {}).get("vocab_size") or config["vocab_size"]
    return model, spread_tokens(prompt_tokens, vocab_size), (
        f"{path} ({library}'s {config.get('model_type')}, loaded in {time.perf_counter() - started:.1f} s)")


def first_line(error: Exception) -> str:
    """An exception's first line of text (mlx-vlm's load errors add a page of advice)."""
    return next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)


def demo(model, prompt: list, what: str, new_tokens: int, repeats: int) -> int:
    print(f"{what} on {mlx_moe_fix.status()['backend']}: prompt {len(prompt)} tokens, {new_tokens} generated, "
          f"best of {repeats} runs", file=sys.stderr)
    mlx_moe_fix.revert()
    stock = timed_generation(model, prompt, new_tokens, repeats)
    mlx_moe_fix.reset_path_counts()
    no_kernel = no_kernel_reason()
    if no_kernel is not None:
        print(f"apply() alone patches nothing here ({no_kernel}); the patched run takes the references, "
              "to show their parity", file=sys.stderr)
    with mlx_moe_fix.patched(references=no_kernel is not None):
        patched = timed_generation(model, prompt, new_tokens, repeats)
    paths = sorted({f"{r.layer} {r.phase}: {r.path}" for r in mlx_moe_fix.path_counts()})
    same = stock["tokens"] == patched["tokens"]
    rows = [
        ["stock", f"{stock['prefill_tok_s']:.0f}", f"{stock['decode_tok_s']:.1f}", "", "stock"],
        [
            "patched",
            f"{patched['prefill_tok_s']:.0f}",
            f"{patched['decode_tok_s']:.1f}",
            "yes" if same else "NO",
            "; ".join(paths),
        ],
        [
            "patched / stock",
            f"{patched['prefill_tok_s'] / stock['prefill_tok_s']:.2f}x",
            f"{patched['decode_tok_s'] / stock['decode_tok_s']:.2f}x",
            "",
            "",
        ],
    ]
    print(markdown_table(["", "prefill tok/s", "decode tok/s", "same greedy tokens", "paths taken"], rows))
    for why in sorted({f"{r.layer} {r.phase}: upstream's code: {r.reason}" for r in mlx_moe_fix.path_counts()
                       if r.path == "stock"}):
        print(why)
    if not same:
        print(f"stock:   {stock['tokens']}\npatched: {patched['tokens']}", file=sys.stderr)
    return 0 if same else 1


def main(argv=None) -> int:
    from .zoo import BREADTH_FAMILIES, FAMILIES

    parser = argparse.ArgumentParser(prog="mlx-moe-fix", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    status_parser = commands.add_parser("status", help="what is patched, deferred or missing, and why")
    status_parser.add_argument("--json", action="store_true")
    demo_parser = commands.add_parser(
        "demo", help="stock vs patched on a built-in small random MoE model: greedy-token parity and timing"
    )
    demo_parser.add_argument("--family", choices=[*FAMILIES, *BREADTH_FAMILIES], metavar="FAMILY",
                             help=f"the zoo's {', '.join(FAMILIES)} (default qwen3_moe), or one of "
                             f"{len(BREADTH_FAMILIES)} more small models of mlx-lm's and mlx-vlm's MoE families: "
                             f"{', '.join(BREADTH_FAMILIES)}")
    demo_parser.add_argument("--model", metavar="PATH_OR_REPO",
                             help="an MLX checkpoint (a folder, or a Hugging Face repo) instead of a built-in model")
    demo_parser.add_argument("--bits", type=int, choices=(4, 8),
                             help="the built-in model's quantization bits (default 4; a checkpoint keeps its own)")
    demo_parser.add_argument("--prompt-tokens", type=int, default=128)
    demo_parser.add_argument("--new-tokens", type=int, default=32)
    demo_parser.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up")
    demo_parser.add_argument("--cpu", action="store_true", help="run on the CPU even where a GPU exists")
    args = parser.parse_args(argv)
    if args.command == "status":
        mlx_moe_fix.apply()
        return show_status(args.json)
    if args.cpu:
        mx.set_default_device(mx.cpu)
    if args.model:
        if args.family is not None or args.bits is not None:
            parser.error("--model takes neither --family nor --bits: a checkpoint is its own family and quantization")
        model, prompt, what = checkpoint_model(args.model, args.prompt_tokens)
    else:
        model, prompt, what = demo_model(args.family or "qwen3_moe", args.bits or 4, args.prompt_tokens)
    return demo(model, prompt, what, args.new_tokens, args.repeats)


if __name__ == "__main__":
    sys.exit(main())
