"""What one decode token asks of MLX: the primitives in the graph of one greedy step, per layer,
for each MoE model of benchmarks/models.py and its dense equivalent, stock and patched.

    python3 -m benchmarks.decode_graph                      # all four families, any device
    python3 -m benchmarks.decode_graph --models qwen3_moe --detail

The graph of a step does not depend on the widths, so the models are the small configs of
`benchmarks/models.py --smoke` (same layer classes, 2 layers): this runs in seconds on a CPU.
Each step's logits graph is exported with `mx.export_to_dot` and its primitives counted.
"Work" primitives are those that compute (most launch one GPU kernel on CUDA; a few launch
several); "views" (reshape, broadcast, slice, ...) launch none. Where the graph is built for the
CPU, MLX's fast ops (rms_norm, rope, scaled_dot_product_attention) appear as their fallback
decompositions, which on a GPU are one primitive each: compare models on one device, and read the
MoE-minus-dense difference (router, expert gather, combine), which no fast op touches. Per layer: half the difference between the
4-layer and the 2-layer model (gpt-oss alternates sliding and full attention, so this is the mean
of the two); "outside" (embedding, final norm, head, sampling) is what the 2-layer model has on
top of two layers.
"""

import argparse
import collections
import dataclasses
import os
import re
import tempfile
from typing import Dict

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import mlx_moe_fix

from .models import MOE_MODELS, VLM_CONFIG_CLASSES, build_model, model_specs
from .timing import markdown_table

# Primitives that only change how an array is viewed: no kernel on CUDA.
VIEWS = {"Broadcast", "Reshape", "Squeeze", "ExpandDims", "Slice", "Transpose", "StopGradient", "Depends",
         "AsStrided", "Flatten", "Unflatten"}


def step_primitives(model, prompt_length: int = 8) -> collections.Counter:
    """Primitive name -> count in the graph of one decode step after a short prompt."""
    cache = make_prompt_cache(model)
    prompt = mx.arange(1, prompt_length + 1)[None]
    mx.eval(model(prompt, cache=cache))
    logits = model(mx.array([[3]]), cache=cache)
    token = mx.argmax(logits[:, -1, :], axis=-1)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "step.dot")
        mx.export_to_dot(path, token)
        text = open(path).read()
    return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', text))


def with_layers(spec, layers: int):
    config = dict(spec.config, num_hidden_layers=layers)
    if "layer_types" in config:  # gpt-oss: the same alternation, as long as the model
        config["layer_types"] = (config["layer_types"] * layers)[:layers]
    if config.get("first_k_dense_replace") == spec.config["num_hidden_layers"]:  # the all-dense DeepSeek
        config["first_k_dense_replace"] = layers
    return dataclasses.replace(spec, config=config)


def split(counts: collections.Counter):
    work = sum(n for name, n in counts.items() if name not in VIEWS)
    return work, sum(counts.values()) - work


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # (its layer-count edits know the mlx-lm models' configs)
    parser.add_argument("--models", default=",".join(m for m in MOE_MODELS if m not in VLM_CONFIG_CLASSES))
    parser.add_argument("--detail", action="store_true", help="also list the primitives of one layer")
    args = parser.parse_args(argv)
    specs = model_specs(smoke=True, deepseek_layers=2)
    rows, details = [], []
    for moe_name in args.models.split(","):
        for name in (moe_name, specs[moe_name].dense):
            per_mode: Dict[str, collections.Counter] = {}
            for mode in ("stock", "patched") if specs[name].moe else ("stock",):
                mlx_moe_fix.apply() if mode == "patched" else mlx_moe_fix.revert()
                two, four = (step_primitives(build_model(with_layers(specs[name], n))) for n in (2, 4))
                two_layers = four - two
                per_mode[mode] = two_layers
                work, views = split(two_layers)
                outside_work, _ = split(two - two_layers)
                rows.append([name, mode, f"{work / 2:g}", f"{views / 2:g}", outside_work])
            mlx_moe_fix.revert()
            if args.detail:
                for mode, layer in per_mode.items():
                    listed = ", ".join(f"{k} {v / 2:g}" for k, v in sorted(layer.items()) if k not in VIEWS)
                    details.append(f"- {name} {mode}: {listed}")
    print(f"MLX {mx.__version__}; one greedy decode step (batch 1) after an 8-token prompt")
    print(markdown_table(["model", "mode", "work primitives / layer", "views / layer",
                          "work primitives outside the layers"], rows))
    if details:
        print("\nWork primitives of one layer:")
        print("\n".join(details))


if __name__ == "__main__":
    main()
