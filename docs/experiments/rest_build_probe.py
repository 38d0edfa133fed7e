"""Eighty-fourth stop (development CPU, no GPU): does the rest of a MoE model (its MoE blocks
returning their input) take longer to *build* a decode step in Python than the rest of its dense
equivalent (its dense MLPs returning their input)? On the GPU that rest read 12-34 µs a layer
slower for deepseek_v4 (docs/decode-attribution.md, section 41), and a graph that is the same node
for node (section 40) should build in the same time. Both rests build one decode step in turns,
--reps times (each step evaluated, untimed, so that the caches advance alike); medians of the
build alone, µs a token. Result: docs/decode-attribution.md, section 42.
Run from the repo root: PYTHONPATH=. python3 docs/experiments/rest_build_probe.py --model deepseek_v4 --smoke"""
import argparse
import statistics
import time

import mlx.core as mx

from benchmarks import models
from benchmarks.decode_attribution import identity, mlp_classes, moe_block_classes, replaced_calls
from benchmarks.decode_timeline import Decoder, prompts_of

parser = argparse.ArgumentParser()
models.add_decode_pair_arguments(parser)
parser.add_argument("--reps", type=int, default=500)
parser.add_argument("--smoke", action="store_true", help="tiny configs (CPU)")
args = parser.parse_args()
args.prompt = 12 if args.smoke else 256
spec, built, tokens = models.build_decode_pair(args)
models.set_mode("stock")
rests = {"MoE model's rest": (built[False], moe_block_classes(built[False])),
         "dense model's rest": (built[True], mlp_classes(built[True]))}
prompts = prompts_of(tokens, 1, spec.config["vocab_size"])
decoders, builds = {}, {label: [] for label in rests}
for label, (model, classes) in rests.items():
    with replaced_calls(classes, identity):
        decoders[label] = Decoder(model, prompts)
        decoders[label].burst(3)
for _ in range(args.reps):
    for label, (model, classes) in rests.items():
        decoder = decoders[label]
        with replaced_calls(classes, identity):
            start = time.perf_counter()
            y, logprobs = decoder.step(decoder.y)
            builds[label].append(time.perf_counter() - start)
            mx.eval(y, logprobs)
            decoder.y = y
layers = spec.config["num_hidden_layers"]
print(f"{args.model} ({layers} layers), {mx.default_device()}, {args.reps} steps each, build µs a token (median):")
for label, times in builds.items():
    print(f"  {label}: {statistics.median(times) * 1e6:.0f}")
