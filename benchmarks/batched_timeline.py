"""Batched decode through mlx-lm's BatchGenerator at several batch sizes: the MoE model stock and
patched and its dense equivalent, in turns of short bursts in one process (decode_timeline's
method: this host's speed drifts by up to 2x over seconds and between processes, so each ratio
is read between bursts run seconds apart).

    python3 -m benchmarks.batched_timeline                        # qwen3_moe, batch 1, 4, 16
    python3 -m benchmarks.batched_timeline --model mixtral --batch-sizes 1,8
    python3 -m benchmarks.batched_timeline --smoke                # tiny configs, CPU

Every (variant, batch size) keeps its own BatchGenerator of that many sequences, started from
prompt caches of --prompt random tokens each that the model built once (the MoE model patched, as
benchmarks.models does), with its next step pending between bursts; a burst
ends once its last step's tokens are computed, so the next starts on an idle GPU. Each cycle
runs every (variant, batch size) once, starting one further on than the cycle before. The table
gives, over every step but each burst's first: the median step time, tok/s counting every
sequence (the median over bursts), `/ dense` (the median over cycles of a burst's tok/s over the
dense equivalent's burst at the same batch size in the same cycle) and `/ batch 1` (the same
against the variant's own batch-1 burst: how the variant scales, to compare with the dense
equivalent's). Issue 5 asks the patched model to scale at least as well as its dense equivalent.
"""

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from . import models
from .decode_timeline import VARIANTS, take_turns
from .timing import log, markdown_table


class BatchedDecoder:
    """One BatchGenerator of `batch` sequences, its next step pending between bursts."""

    def __init__(self, model, prompts: list, caches: list, batch: int, steps: int):
        self.batch = batch
        self.generator = models.batch_generator(model, prompts, caches, batch, steps)

    def burst(self, steps: int) -> list:
        """Seconds per step."""
        seconds = []
        for _ in range(steps):
            start = time.perf_counter()
            responses = self.generator.next_generated()
            seconds.append(time.perf_counter() - start)
            if len(responses) != self.batch:
                raise RuntimeError(f"a step of batch {self.batch} returned {len(responses)} sequences: --cycles too many for max_tokens")
        mx.synchronize(self.generator.stream)
        return seconds

    def close(self):
        self.generator.close()


def batch_sizes(text: str) -> list:
    sizes = models.int_list(text)
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated batch sizes of at least 1")
    return sorted(set(sizes))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    models.add_decode_pair_arguments(parser)
    parser.add_argument("--batch-sizes", type=batch_sizes, default=[1, 4, 16], help="comma-separated (default 1,4,16)")
    parser.add_argument("--burst", type=int, default=8, help="steps a (variant, batch size) decodes per turn")
    parser.add_argument("--cycles", type=int, default=12, help="turns of every (variant, batch size)")
    parser.add_argument("--smoke", action="store_true", help="tiny configs, few steps (CPU)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompt, args.burst, args.cycles = 12, 3, 2
    if args.burst < 2:
        parser.error("--burst must be at least 2 (a burst's first step is left out)")
    if args.model in models.NO_BATCHED_DECODE:
        parser.error(f"--model {args.model}: its caches do not go through BatchGenerator")

    spec, built, _ = models.build_decode_pair(args)
    vocab, largest = spec.config["vocab_size"], max(args.batch_sizes)
    prompts = np.random.default_rng(0).integers(0, vocab, (largest, args.prompt)).tolist()
    settings = argparse.Namespace(prefill_step_size=2048)
    log(f"[batched] prefilling {largest} prompts of {args.prompt} tokens into each model's caches")
    caches = {}
    for dense in (False, True):
        models.set_mode("stock" if dense else "patched")
        caches[dense] = models.build_prompt_caches(built[dense], prompts, settings)
    steps = args.burst * (args.cycles + 1) + 1  # the warm-up burst, the cycles' and the first step
    log("[batched] a generator per variant and batch size, each warmed up")
    decoders, seconds, rates = {}, {}, {}
    for label, (dense, mode, _) in VARIANTS.items():
        for batch in args.batch_sizes:
            models.set_mode(mode)
            decoders[label, batch] = BatchedDecoder(built[dense], prompts, caches[dense], batch, steps)
            decoders[label, batch].burst(args.burst)  # warm-up at exactly the timed shapes (compiled steps traced)
            seconds[label, batch], rates[label, batch] = [], []

    def turn(key):
        models.set_mode(VARIANTS[key[0]][1])
        run = decoders[key].burst(args.burst)[1:]
        seconds[key] += run
        rates[key].append(key[1] * len(run) / sum(run))

    take_turns(list(decoders), args.cycles, turn, "batched")
    models.set_mode("stock")
    for decoder in decoders.values():
        decoder.close()

    def versus(key, other):
        return f"{statistics.median(r / o for r, o in zip(rates[key], rates[other])):.3f}" if other in rates else "-"

    print(f"{args.model} and its dense equivalent through BatchGenerator, {args.prompt}-token prompts, {args.cycles} "
          f"cycles of {args.burst}-step bursts, MLX {mx.__version__}, {mx.default_device()}; medians")
    rows = [[label, str(batch), f"{statistics.median(seconds[label, batch]) * 1e3:.2f}",
             f"{statistics.median(rates[label, batch]):.1f}", versus((label, batch), ("dense equivalent", batch)),
             versus((label, batch), (label, 1))]
            for label in VARIANTS for batch in args.batch_sizes]
    print(markdown_table(["variant", "batch", "step ms", "tok/s", "/ dense", "/ batch 1"], rows))


if __name__ == "__main__":
    main()
