"""The grouped prefill's device-side routing: ref (pure MLX ops, every backend) and the CUDA
kernel, against the same properties (the kernel may order rows within an expert's run
differently)."""

import importlib

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_moe_fix.kernels.moe_prefill import TILES, route_kernel, route_reference

# the module (the package's name moe_prefill is its dispatcher)
PREFILL = importlib.import_module("mlx_moe_fix.kernels.moe_prefill")


@pytest.fixture(params=["ref", pytest.param("cuda", marks=pytest.mark.gpu),
                        pytest.param("cuda, 64 pairs a block", marks=pytest.mark.gpu)])
def route(request, monkeypatch):
    if request.param == "ref":
        yield route_reference
        return
    if not mx.cuda.is_available():
        pytest.skip("no CUDA: MLX reports no CUDA GPU on this machine")
    if request.param.endswith("a block"):  # many blocks, each scattering its chunk of the pairs
        monkeypatch.setattr(PREFILL, "ROUTE_PAIRS_PER_BLOCK", 64)
    previous = mx.default_device()
    mx.set_default_device(mx.gpu)
    yield route_kernel
    mx.set_default_device(previous)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_experts=st.integers(1, 40),
    pairs=st.integers(1, 600),
    skew=st.sampled_from(["uniform", "one_expert", "two_experts"]),
    seed=st.integers(0, 2**16),
    tile=st.sampled_from(TILES),
)
def test_route_pads_each_expert_run_to_whole_tiles(route, num_experts, pairs, skew, seed, tile):
    rng = np.random.default_rng(seed)
    high = {"uniform": num_experts, "one_expert": 1, "two_experts": min(2, num_experts)}[skew]
    experts = rng.integers(0, high, pairs).astype(np.uint32)
    assert_routes(experts, num_experts, tile, *route(mx.array(experts), num_experts, tile))


def assert_routes(experts: np.ndarray, num_experts: int, tile: int, row_pair, tile_expert, tiles: int) -> None:
    """route_reference's contract for the pairs' `experts`, rows within a run in any order."""
    pairs = len(experts)
    row_pair, tile_expert = np.array(row_pair), np.array(tile_expert)

    assert row_pair.shape == (tiles * tile,) and tile_expert.shape == (tiles,)
    assert sorted(row_pair[row_pair >= 0].tolist()) == list(range(pairs)), "every pair exactly once"
    used = tile_expert >= 0
    assert used.sum() == sum(-(-int((experts == e).sum()) // tile) for e in range(num_experts))
    assert (np.diff(used.astype(int)) <= 0).all(), "used tiles come first"
    for index in range(tiles):
        rows = row_pair[index * tile:(index + 1) * tile]
        if not used[index]:
            assert (rows < 0).all()
            continue
        valid = rows[rows >= 0]
        assert len(valid) and (experts[valid] == tile_expert[index]).all(), "a tile holds one expert's pairs"
        assert (rows[: len(valid)] >= 0).all(), "padding only at the end of a tile"
    assert (np.diff(tile_expert[used]) >= 0).all(), "tiles in expert order"


def most_tiles_routing(num_experts: int, pairs: int, tile: int) -> np.ndarray:
    """A routing that fills the most tiles `pairs` pairs can: each of min(experts, pairs) experts
    one pair past whole tiles (the rest of the pairs in whole tiles, the last few with expert 0)."""
    used = min(num_experts, pairs)
    counts = np.ones(used, dtype=np.int64)
    whole, rest = divmod(pairs - used, tile)
    counts += tile * np.bincount(np.arange(whole) % used, minlength=used)
    counts[0] += rest
    return np.repeat(np.arange(used), counts).astype(np.uint32)


@pytest.mark.parametrize("num_experts, pairs, tile", [(256, 64, 16), (256, 128, 16), (256, 1024, 16), (40, 100, 64),
                                                      (8, 9, 32), (3, 600, 64)])
def test_route_fills_the_grid_in_its_worst_case(route, num_experts, pairs, tile):
    # the grid (grid_tiles) is sized for the worst case and no larger: that routing uses every tile
    experts = most_tiles_routing(num_experts, pairs, tile)
    assert len(experts) == pairs
    row_pair, tile_expert, tiles = route(mx.array(experts), num_experts, tile)
    assert tiles == PREFILL.grid_tiles(pairs, num_experts, tile)
    assert_routes(experts, num_experts, tile, row_pair, tile_expert, tiles)
    assert (np.array(tile_expert) >= 0).all()


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(0, 300), min_size=1, max_size=300), tile=st.sampled_from(TILES))
def test_no_routing_fills_more_tiles_than_the_grid(counts, tile):
    pairs = sum(counts)
    assert sum(-(-c // tile) for c in counts) <= PREFILL.grid_tiles(pairs, len(counts), tile)
