"""Forty-third session (CPU, smoke widths): the rest of deepseek_v4's MoE model (its MoE blocks returning
their input) against the rest of its dense equivalent (its dense MLPs returning their input): the
primitives of one decode token's graph, counted by kind. Result: docs/decode-attribution.md, section 40.
Run from the repo root: PYTHONPATH=. python3 docs/experiments/deepseek_v4_rest_graph.py"""
from collections import Counter

import mlx.core as mx
from mlx_vlm.models.linear import DECODE_BLOCK_SIZE

from benchmarks.decode_attribution import identity, mlp_classes, moe_block_classes, replaced_calls
from benchmarks.models import build_model, model_specs
from tests.parity.test_router import primitives_of

specs = model_specs(smoke=True, deepseek_layers=2)
counts = {}
for name in ("deepseek_v4", "deepseek_v4_dense"):
    model = build_model(specs[name])
    classes = moe_block_classes(model) if name == "deepseek_v4" else mlp_classes(model)
    with replaced_calls(classes, identity):
        cache = model.make_cache()
        # a prompt past mlx-vlm's DECODE_BLOCK_SIZE (8): within it the MoE block takes the hyper-connection
        # residual and returns its expansion, which a block returning its input cannot stand for
        mx.eval(model(mx.array([list(range(1, DECODE_BLOCK_SIZE + 2))]), cache=cache))
        mx.eval([c.state for c in cache if hasattr(c, "state")])
        logits = model(mx.array([[DECODE_BLOCK_SIZE + 2]]), cache=cache)
        counts[name] = Counter(primitives_of(logits))
    print(name, "blocks replaced:", sorted(c.__name__ for c in classes), "nodes:", sum(counts[name].values()))
moe, dense = counts["deepseek_v4"], counts["deepseek_v4_dense"]
print("only in the MoE model's rest:", dict(moe - dense))
print("only in the dense model's rest:", dict(dense - moe))
