"""Forty-fifth session (H200): is the rest of deepseek_v4's MoE model (its MoE blocks returning their
input) slower than the rest of its dense equivalent (its dense MLPs returning their input) because
of the experts' resident memory? Both rests decode in turns (benchmarks.decode_timeline's bursts,
stock mode), then the MoE model's experts are freed and the same decoders take turns again.
Result: docs/decode-attribution.md, section 41; docs/benchmarks.md, forty-fifth session, item 6.
Run from the repo root: PYTHONPATH=. python3 docs/experiments/deepseek_v4_rest_memory_probe.py [deepseek_v4|qwen3_moe] [smoke]"""
import argparse, gc, statistics, sys
import mlx.core as mx, mlx.nn as nn
from benchmarks import models
from benchmarks.decode_timeline import Decoder, prompts_of, take_turns
from benchmarks.decode_attribution import identity, mlp_classes, moe_block_classes, replaced_calls

model_name = sys.argv[1] if len(sys.argv) > 1 else "deepseek_v4"
smoke = "smoke" in sys.argv
args = argparse.Namespace(model=model_name, deepseek_layers=6, prompt=12 if smoke else 256, smoke=smoke)
spec, built, tokens = models.build_decode_pair(args)
models.set_mode("stock")
moe, dense = built[False], built[True]
swaps = {"moe rest": (moe, moe_block_classes(moe)), "dense rest": (dense, mlp_classes(dense))}
prompts = prompts_of(tokens, 1, spec.config["vocab_size"])
decoders = {}
for label, (model, classes) in swaps.items():
    with replaced_calls(classes, identity):
        decoders[label] = Decoder(model, prompts); decoders[label].burst(8)

def run(phase, cycles=2 if smoke else 8):
    times = {label: [] for label in swaps}
    def turn(label):
        with replaced_calls(swaps[label][1], identity):
            r = decoders[label].burst(8)
        times[label] += [sum(p) for p in r[1:]]
    take_turns(list(swaps), cycles, turn, phase)
    m = {l: statistics.median(t) * 1e6 for l, t in times.items()}
    print(f"{phase}: active memory {mx.get_active_memory()/1e9:.1f} GB; moe rest {m['moe rest']:.0f} µs, dense rest {m['dense rest']:.0f} µs, "
          f"(moe - dense) / layer {(m['moe rest'] - m['dense rest']) / spec.config['num_hidden_layers']:.1f} µs", flush=True)

run("experts resident")
freed = 0
for _, m in moe.named_modules():
    if hasattr(m, "switch_mlp"):
        freed += sum(v.nbytes for _, v in nn.utils.tree_flatten(m.switch_mlp.parameters()))
        m.switch_mlp = nn.Identity()
gc.collect(); mx.clear_cache()
print(f"freed {freed/1e9:.1f} GB of experts")
run("experts freed")
run("experts freed, again")
