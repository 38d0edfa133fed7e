"""Forty-sixth session: the first token's log-probabilities and greedy tokens that
docs/experiments/kernel_cache_probe.py saved in several processes, each against the first named.
    python3 docs/experiments/compare_probe_outputs.py DIR offA offB onFill ..."""
import sys
import numpy as np
base = sys.argv[1]; tags = sys.argv[2:]
lp = {t: np.load(f"{base}/{t}_logprobs.npy") for t in tags}
tk = {t: np.load(f"{base}/{t}_tokens.npy").tolist() for t in tags}
print("tokens:", {t: tk[t] for t in tags})
ref = tags[0]
for t in tags[1:]:
    d = np.abs(lp[t] - lp[ref])
    print(f"{t} vs {ref}: max |dlogprob| {d.max():.4g}, mean {d.mean():.3g}, identical {bool((lp[t]==lp[ref]).all())}, argmax same {int(lp[t].argmax())==int(lp[ref].argmax())}")
