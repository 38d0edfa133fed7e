"""Forty-third session probe: which step of the shared experts' reference (shared_experts_reference:
RouterLinear.__call__, i.e. mx.quantized_matmul, for up and gate, the activation, the weights'
repeat and product, the down's quantized_matmul) first differs between MLX on the GPU and on the
CPU, from the same input arrays, in a process where no kernel of ours runs. Inkling's shared
expert (1, width 64), bf16, 4-bit, D 64 / 128, k 1 / 2, T 1 / 2 / 5, 6 seeds each.
Results: docs/benchmarks.md, forty-third session, item 2."""
import itertools
import sys

import mlx.core as mx
import numpy as np

sys.path.insert(0, ".")
from tests.parity.test_shared_decode import make_shared_case  # noqa: E402
from mlx_moe_fix.kernels import Routing  # noqa: E402
from mlx_moe_fix.kernels.moe_router import moe_router_reference  # noqa: E402
from mlx_moe_fix.kernels.reference import activate  # noqa: E402


def steps(case, logits, routing, correction, device):
    with mx.stream(device):
        _, _, sw = moe_router_reference(logits, routing, correction, mx.array([1.0]))
        sh = case.shared
        up, gate = sh.up(case.x), sh.gate(case.x)
        act = activate(sh.activation, up, gate)
        rep = mx.repeat(sw, sh.width, axis=-1)
        hidden = act * rep
        out = sh.down(hidden)
        named = dict(shared_weights=sw, up=up, gate=gate, act=act, repeat=rep, hidden=hidden, down=out)
        mx.eval(*named.values())
    return named


counts = {}
shown = 0
for dims, k, tokens, seed in itertools.product((64, 128), (1, 2), (1, 2, 5), range(6)):
    case = make_shared_case("inkling", mx.bfloat16, 4, dims, 64, 8, k, 1, tokens, seed=seed)
    logits = (mx.random.normal((tokens, 9)) * 3).astype(mx.bfloat16)
    correction = mx.round(mx.random.uniform(-0.5, 0.5, (8,)) * 4) / 4
    routing = Routing("sigmoid_topk", k, shared=1, shared_width=1, scale=2.5)
    g = steps(case, logits, routing, correction, mx.gpu)
    c = steps(case, logits, routing, correction, mx.cpu)
    for name in g:
        a, b = np.asarray(g[name].astype(mx.float32)), np.asarray(c[name].astype(mx.float32))
        err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30) if np.isfinite(a).all() else float("inf")
        if err > 2e-2:
            counts[name] = counts.get(name, 0) + 1
            if shown < 8:
                shown += 1
                print(f"D={dims} k={k} T={tokens} seed={seed}: first differing step {name} (rel {err:.3g});",
                      "gpu", g[name].dtype, g[name].shape, a.ravel()[:6], "cpu", b.ravel()[:6],
                      "| its inputs' dtypes/shapes:", {n: (str(v.dtype), v.shape) for n, v in g.items()}, flush=True)
            break
print("first differing step, count of cases (of 72):", counts)
