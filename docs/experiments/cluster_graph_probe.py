"""Forty-second session probe: do later plain MLX graphs come out unwritten after the patched routed
blocks ran? Run at 1f57716, where moe_routed_decode.ROUTER_CLUSTER still set the fused router's
clusters; since 1324b31 the launch has none and the assignment below changes nothing.
argv: cluster (0: fused router off; 1: fused, launched without clusters; 8: fused, clusters of 8), rounds.
Results: docs/benchmarks.md, forty-second session, item 1."""
import os
import sys
import time

cluster, rounds = int(sys.argv[1]), int(sys.argv[2])
if cluster:
    os.environ["MLX_MOE_FIX_CUDA_FUSED_ROUTER"] = "1"
import mlx.core as mx

import mlx_moe_fix
import mlx_moe_fix.kernels.moe_routed_decode as routed
from mlx_moe_fix import zoo
from mlx_moe_fix.kernels import Routing
from mlx_moe_fix.kernels.moe_router import moe_router_kernel, moe_router_reference
from tests.parity.test_graph_safety import routing_graph_mismatches, run_patched_blocks
from tests.parity.test_router import BLOCK_FAMILIES, first_block

if cluster:
    routed.ROUTER_CLUSTER = cluster
start = time.time()
run_patched_blocks()
blocks_then = len(routing_graph_mismatches())

# interleaved: a patched block's decode step, then a router-test-like graph (our router kernel, then the reference)
models = {f: zoo.build(f, 4, dtype=mx.bfloat16) for f in BLOCK_FAMILIES}
bad_interleaved, bad_router, total = 0, 0, 0
with mlx_moe_fix.patched():
    for r in range(rounds):
        for family, model in models.items():
            block = first_block(model)
            x = (mx.random.normal((1, 1, model.args.hidden_size), key=mx.random.key(r)) * 0.5).astype(mx.bfloat16)
            mx.eval(block(x))
            bad_interleaved += len(routing_graph_mismatches(3))
            logits = (mx.round(mx.random.normal((2, 60), key=mx.random.key(1000 + r)) * 4) / 4).astype(mx.bfloat16)
            routing = Routing("softmax_topk", 1 + r % 4)
            indices, weights = moe_router_kernel(logits, routing)
            expected_indices, expected_weights = moe_router_reference(logits, routing)
            ok = indices.tolist() == expected_indices.astype(mx.uint32).tolist() and mx.array_equal(weights, expected_weights).item()
            bad_router += not ok
            total += 1
print(f"PROBE cluster={cluster} graphs={os.environ.get('MLX_USE_CUDA_GRAPHS', 'default')} "
      f"blocks-then-graphs mismatches {blocks_then}/60; interleaved graph mismatches {bad_interleaved}/{3 * total}; "
      f"router-test pattern mismatches {bad_router}/{total}; {time.time() - start:.0f} s", flush=True)
