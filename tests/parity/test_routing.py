"""The grouped prefill's device-side routing (pure MLX ops, so it runs on every backend)."""

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_moe_fix.kernels.moe_prefill import TILE, route


@settings(max_examples=40, deadline=None)
@given(
    num_experts=st.integers(1, 40),
    pairs=st.integers(1, 600),
    skew=st.sampled_from(["uniform", "one_expert", "two_experts"]),
    seed=st.integers(0, 2**16),
)
def test_route_pads_each_expert_run_to_whole_tiles(num_experts, pairs, skew, seed):
    rng = np.random.default_rng(seed)
    high = {"uniform": num_experts, "one_expert": 1, "two_experts": min(2, num_experts)}[skew]
    experts = rng.integers(0, high, pairs).astype(np.uint32)
    row_pair, tile_expert, tiles = route(mx.array(experts), num_experts)
    row_pair, tile_expert = np.array(row_pair), np.array(tile_expert)

    assert row_pair.shape == (tiles * TILE,) and tile_expert.shape == (tiles,)
    assert sorted(row_pair[row_pair >= 0].tolist()) == list(range(pairs)), "every pair exactly once"
    used = tile_expert >= 0
    assert used.sum() == sum(-(-int((experts == e).sum()) // TILE) for e in range(num_experts))
    assert (np.diff(used.astype(int)) <= 0).all(), "used tiles come first"
    for tile in range(tiles):
        rows = row_pair[tile * TILE:(tile + 1) * TILE]
        if not used[tile]:
            assert (rows < 0).all()
            continue
        valid = rows[rows >= 0]
        assert len(valid) and (experts[valid] == tile_expert[tile]).all(), "a tile holds one expert's pairs"
        assert (rows[: len(valid)] >= 0).all(), "padding only at the end of a tile"
    assert (np.diff(tile_expert[used]) >= 0).all(), "tiles in expert order"
