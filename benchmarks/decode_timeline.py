"""Where a decode token's wall time goes on the host: building its graph in Python, MLX's
submission of it (mx.async_eval: each primitive's encoding, the CUDA graphs' commits, and any wait
for earlier work MLX makes there), and waiting for its result.

    python3 -m benchmarks.decode_timeline                           # qwen3_moe, 24 cycles
    python3 -m benchmarks.decode_timeline --model mixtral --burst 8
    python3 -m benchmarks.decode_timeline --smoke                   # tiny configs, CPU
    python3 -m benchmarks.decode_timeline --batch 4                 # 4 sequences a step, one cache
    python3 -m benchmarks.decode_timeline --patched-with MLX_MOE_FIX_CUDA_ROUTED_DECODE=0
                                        # one more variant: patched with that switch set
    python3 -m benchmarks.decode_timeline --block-variant moe-identity --block-variant dense-identity \
        --block-variant compiled-step --block-variant eager-kernels --block-variant fixed-logits
                                        # where the patched block's host time goes, in the model

The loop is mlx-lm's generate_step's (greedy, log-probabilities computed, on its generation
stream, token t+1 built and submitted before token t is waited for), written out so that each of
the three host phases is timed per token. This host's speed drifts by up to 2x over seconds and
between processes (docs/benchmarks.md), so the variants (the MoE model stock and patched, its
dense equivalent: benchmarks/models.py) take turns in short bursts of --burst tokens, each model
with its own cache and its next token pending, for --cycles cycles in one process (each cycle
starting one variant further on, so that over a multiple of their number of cycles every variant
takes every place in the turn equally often); a burst ends
once its last token is computed, so the next starts on an idle GPU. The table gives medians over
every token but each burst's first (its build had nothing to overlap), µs per token; tok/s is
per burst, and `/ dense` the median over cycles of a burst's tok/s over the dense burst's of the
same cycle.

--block-variant swaps a layer's call, by its class, for one variant's bursts: `moe-identity` (each
MoE block returns its input) and `dense-identity` (each dense MLP of the dense equivalent does)
give what the rest of each model costs; `compiled-step` calls the patched block's last compiled
step directly (no wrapper); for qwen3_moe and mixtral, whose blocks moe_routed_decode takes at
decode, `eager-kernels` builds the router and the two decode launches in Python (no wrapper, no
compiled step) and `fixed-logits` the launches alone, with constant router logits (no router
node). `shared-launches` and `layer-launches` build the same router node and launches inside an
`mx.compile`d function of the token and the block's weights: one function for all layers (one
compiled graph replayed by every layer), or one a layer; `tree-launches` is shared-launches with
the block's module tree as the argument (as the patched block's compiled steps take it). Calls other than a
decode step's (the prompt) run the block as patched.
"""

import argparse
import contextlib
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from mlx_moe_fix import env
from mlx_moe_fix.patches import moe_blocks
from mlx_moe_fix.patches.switch_layers import PROJECTION_ARRAYS

from . import models
from .decode_attribution import identity, mlp_classes, moe_block_classes, replaced_calls
from .decode_split import switched
from .timing import log, markdown_table

# label: (the dense equivalent?, models.set_mode's mode, (switch, value) set for its bursts or None)
VARIANTS = {"stock": (False, "stock", None), "patched": (False, "patched", None), "dense equivalent": (True, "stock", None)}
PHASES = ("build", "submit", "wait")
# --block-variant: what a variant swaps, and the routing of the blocks whose calls eager-kernels and
# fixed-logits rebuild (those moe_routed_decode takes at decode), by --model
BLOCK_VARIANTS = ("moe-identity", "dense-identity", "compiled-step", "eager-kernels", "fixed-logits",
                  "shared-launches", "layer-launches", "tree-launches")
REBUILT = ("eager-kernels", "fixed-logits", "shared-launches", "layer-launches", "tree-launches")
ROUTINGS = {"qwen3_moe": moe_blocks.qwen3_moe_routing, "mixtral": moe_blocks.mixtral_routing}


def block_variant(variant: str, model_name: str, built: dict) -> tuple:
    """(the dense equivalent?, the classes whose __call__ the variant swaps, make(a class's own
    call) -> its replacement) for a --block-variant."""
    from mlx_moe_fix.patches import compiled

    from .switch_glu import experts_of

    if variant == "dense-identity":
        return True, mlp_classes(built[True]), lambda own: identity
    if variant == "moe-identity":
        return False, moe_block_classes(built[False]), lambda own: identity
    if variant == "compiled-step":
        def make(own):
            def compiled_step(self, x, *args, **kwargs):
                # (DeepSeek-V4's blocks take the token ids after x: their steps have two arguments)
                last = self.__dict__.get(compiled._LAST_STEP)
                if kwargs or last is None or last.shape != x.shape or 1 + len(args) != last.arity:
                    return own.__get__(self, type(self))(x, *args, **kwargs)
                return last.step(self, (x, *args), {})
            return compiled_step
        return False, moe_block_classes(built[False]), make
    # the router and the decode launches called here
    from mlx_moe_fix.kernels.moe_routed_decode import moe_routed_decode_kernel

    if variant in ("shared-launches", "layer-launches", "tree-launches"):
        return False, moe_block_classes(built[False]), compiled_launches(variant, model_name)

    plans = {}

    def plan(block, x):
        if id(block) not in plans:
            logits = block.gate(x)
            mx.eval(logits)
            plans[id(block)] = (experts_of(block.switch_mlp), ROUTINGS[model_name](block), logits)
        return plans[id(block)]

    def make(own):
        def launches(self, x):
            if x.shape[-2] != 1:
                return own.__get__(self, type(self))(x)
            experts, routing, fixed_logits = plan(self, x)
            return moe_routed_decode_kernel(x, fixed_logits if variant == "fixed-logits" else self.gate(x), routing, experts)
        return launches
    return False, moe_block_classes(built[False]), make


def _weights(experts) -> list:
    return [getattr(p, name) for p in experts.projections for name in PROJECTION_ARRAYS if getattr(p, name) is not None]


def _with_weights(experts, arrays: list):
    """`experts` with its projections' arrays taken in _weights' order from `arrays`."""
    from dataclasses import replace

    arrays = iter(arrays)
    projections = tuple(replace(p, **{name: next(arrays) for name in PROJECTION_ARRAYS if getattr(p, name) is not None})
                        for p in experts.projections)
    return replace(experts, projections=projections)


def compiled_launches(variant: str, model_name: str):
    """make(own) for shared-launches (one compiled function for every layer, the block's weights
    its arguments), layer-launches (the same, one a layer) and tree-launches (shared-launches with
    the block's module tree as the argument, as the patched block's compiled steps take it): the
    router's quantized matmul and moe_routed_decode's launches."""
    from mlx_moe_fix.kernels.moe_routed_decode import moe_routed_decode_kernel

    from .switch_glu import experts_of

    functions, descriptions = {}, {}

    def step_of(block):
        if id(block) not in descriptions:
            descriptions[id(block)] = experts_of(block.switch_mlp)
        key = id(block) if variant == "layer-launches" else "every layer"
        if key not in functions:
            gate, experts, routing = block.gate, descriptions[id(block)], ROUTINGS[model_name](block)
            config = dict(transpose=True, group_size=gate.group_size, bits=gate.bits, mode=getattr(gate, "mode", "affine"))

            def step(x, gate_arrays, expert_arrays):
                logits = mx.quantized_matmul(x, *gate_arrays, **config)
                return moe_routed_decode_kernel(x, logits, routing, _with_weights(experts, expert_arrays))

            def tree_step(tree, x):
                gate, switch = tree["gate"], tree["switch_mlp"]
                return step(x, [gate["weight"], gate["scales"], gate["biases"]],
                            [switch[p][n] for p in ("gate_proj", "up_proj", "down_proj") for n in PROJECTION_ARRAYS if n in switch[p]])
            functions[key] = mx.compile(tree_step if variant == "tree-launches" else step)
        return functions[key], descriptions[id(block)]

    def make(own):
        def launches(self, x):
            if x.shape[-2] != 1:
                return own.__get__(self, type(self))(x)
            step, experts = step_of(self)
            if variant == "tree-launches":
                return step(self, x)
            gate = self.gate
            return step(x, [gate["weight"], gate["scales"], gate["biases"]], _weights(experts))
        return launches
    return make


def with_setting(setting):
    """decode_split.switched(*setting) for a variant's bursts, or nothing where setting is None."""
    return contextlib.nullcontext() if setting is None else switched(*setting)


def switch_setting(text: str) -> tuple:
    """NAME=VALUE of one of env.SWITCHES, for argparse."""
    name, _, value = text.partition("=")
    if name not in env.SWITCHES or value not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=0 or NAME=1, NAME one of {', '.join(env.SWITCHES)}")
    return name, value


def add_batch_argument(parser) -> None:
    parser.add_argument("--batch", type=batch_size, default=1,
                        help="sequences decoded at once (the first the --prompt tokens, the others random ones of its length)")


def batch_size(text: str) -> int:
    size = int(text)
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a batch size of at least 1")
    return size


def prompts_of(tokens: list, batch: int, vocab: int) -> mx.array:
    """[batch, len(tokens)]: `tokens`, then batch - 1 random prompts of its length."""
    others = np.random.default_rng(1).integers(0, vocab, (batch - 1, len(tokens))).tolist()
    return mx.array([tokens] + others)


class Decoder:
    """One model's greedy decode of a batch of prompts ([batch, tokens], all of one length: one
    cache), its next tokens pending between bursts."""

    def __init__(self, model, prompts: mx.array):
        self.model, self.cache = model, make_prompt_cache(model)
        with mx.stream(generation_stream):
            model(prompts[:, :-1], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        self.y, self.logprobs = self.step(prompts[:, -1])
        mx.eval(self.y, self.logprobs)

    def step(self, y):
        with mx.stream(generation_stream):
            logits = self.model(y[:, None], cache=self.cache)[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return mx.argmax(logprobs, axis=-1), logprobs

    def burst(self, tokens: int) -> list:
        """[(build, submit, wait) seconds] per token."""
        phases = []
        for _ in range(tokens):
            start = time.perf_counter()
            next_y, next_logprobs = self.step(self.y)
            built = time.perf_counter()
            mx.async_eval(next_y, next_logprobs)
            submitted = time.perf_counter()
            self.y.tolist()
            phases.append((built - start, submitted - built, time.perf_counter() - submitted))
            self.y, self.logprobs = next_y, next_logprobs
        self.y.tolist()
        return phases


def take_turns(labels: list, cycles: int, turn, tag: str) -> None:
    """`turn(label)` for every label, `cycles` times, each cycle starting one label further on: no
    variant always follows the same one (in one process, main's path under two labels, one run
    after stock's turn and one after another patched variant's, read 3% apart: docs/benchmarks.md,
    thirtieth session)."""
    for cycle in range(cycles):
        for label in labels[cycle % len(labels):] + labels[:cycle % len(labels)]:
            turn(label)
        if (cycle + 1) % 8 == 0 or cycle + 1 == cycles:
            log(f"[{tag}] cycle {cycle + 1} of {cycles}")


def summary_row(label: str, phases: list, rates: list, dense_rates: list, layers: int) -> list:
    per_phase = [statistics.median(p[i] for p in phases) * 1e6 for i in range(len(PHASES))]
    token = statistics.median(sum(p) for p in phases) * 1e6
    tok_s = statistics.median(rates)
    versus = statistics.median(r / d for r, d in zip(rates, dense_rates))
    return [label, *(f"{v:.0f}" for v in per_phase), f"{token:.0f}", f"{token / layers:.1f}",
            f"{tok_s:.1f}", f"{versus:.3f}"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    models.add_decode_pair_arguments(parser)
    add_batch_argument(parser)
    parser.add_argument("--burst", type=int, default=8, help="tokens a variant decodes per turn")
    parser.add_argument("--cycles", type=int, default=24, help="turns of every variant")
    parser.add_argument("--smoke", action="store_true", help="tiny configs, few tokens (CPU)")
    parser.add_argument("--patched-with", type=switch_setting, action="append", default=[], metavar="NAME=VALUE",
                        help="one more variant: patched with this switch set (repeatable: one variant each)")
    parser.add_argument("--block-variant", action="append", default=[], choices=BLOCK_VARIANTS,
                        help="one more variant: a layer's call swapped (see above; " + ", ".join(REBUILT) + ": "
                             "qwen3_moe and mixtral on CUDA; repeatable)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompt, args.burst, args.cycles = 12, 3, 2
    if args.burst < 2:
        parser.error("--burst must be at least 2 (a burst's first token is left out)")

    rebuilt = set(REBUILT) & set(args.block_variant)
    if rebuilt and args.model not in ROUTINGS:
        parser.error(f"--block-variant {' and '.join(sorted(rebuilt))}: --model {' or '.join(ROUTINGS)} only")
    spec, built, tokens = models.build_decode_pair(args)
    # label: (dense?, mode, switch setting, (classes swapped, make) or None)
    variants = {label: (*variant, None) for label, variant in VARIANTS.items()}
    variants.update({f"patched, {name}={value}": (False, "patched", (name, value), None) for name, value in args.patched_with})
    for name in args.block_variant:
        dense, classes, make = block_variant(name, args.model, built)
        variants[f"{'dense equivalent' if dense else 'patched'}, {name}"] = (dense, "stock" if dense else "patched", None,
                                                                           (classes, make))
    layers = spec.config["num_hidden_layers"]
    prompts = prompts_of(tokens, args.batch, spec.config["vocab_size"])
    decoders, phases, rates = {}, {label: [] for label in variants}, {label: [] for label in variants}
    for label, (dense, mode, setting, swap) in variants.items():
        models.set_mode(mode)
        with with_setting(setting), replaced_calls(*(swap or ((), None)), around=True):
            decoders[label] = Decoder(built[dense], prompts)
            decoders[label].burst(args.burst)  # warm-up at exactly the timed shapes (compiled steps traced)

    def turn(label):
        dense, mode, setting, swap = variants[label]
        models.set_mode(mode)
        with with_setting(setting), replaced_calls(*(swap or ((), None)), around=True):
            run = decoders[label].burst(args.burst)
        phases[label] += run[1:]
        rates[label].append(args.batch * (args.burst - 1) / sum(map(sum, run[1:])))

    take_turns(list(variants), args.cycles, turn, "timeline")
    models.set_mode("stock")

    print(f"{args.model} ({layers} layers) and its dense equivalent, batch {args.batch}, {args.prompt}-token prompts, "
          f"{args.cycles} cycles of {args.burst}-token bursts, MLX {mx.__version__}, {mx.default_device()}; "
          "µs per step (a token of each sequence), medians; tok/s counts every sequence")
    rows = [summary_row(label, phases[label], rates[label], rates["dense equivalent"], layers) for label in variants]
    print(markdown_table(["variant", *PHASES, "token", "token / layer", "tok/s", "/ dense"], rows))


if __name__ == "__main__":
    main()
