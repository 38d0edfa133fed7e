"""The CUDA launchers' arguments, on any machine: kernel objects replaced by recorders, so that
what a launch would be given is checked where no GPU runs it."""

import sys

import mlx.core as mx

from .parity.cases import make_case

import mlx_moe_fix.kernels  # noqa: F401  loads the op modules (their names are the dispatchers')

PREFILL = sys.modules["mlx_moe_fix.kernels.moe_prefill"]


class Recorder:
    def __init__(self, section):
        self.section, self.calls = section, []

    def __call__(self, **launch):
        self.calls.append(launch)
        return [mx.zeros(shape, dtype) for shape, dtype in zip(launch["output_shapes"], launch["output_dtypes"])]


def test_grouped_launches_are_built_once_per_layer_stage_and_tile(monkeypatch):
    recorders = {}
    monkeypatch.setattr(PREFILL, "cuda_kernel_object",
                        lambda filename, section, *rest: recorders.setdefault(section, Recorder(section)))
    built = []
    build = PREFILL._grouped_launch
    monkeypatch.setattr(PREFILL, "_grouped_launch", lambda experts, stage, *rest: built.append(stage) or build(experts, stage, *rest))
    case = make_case(mx.bfloat16, (4, 64), True, "swiglu", 7.0, False, 128, 256, 8, 2, 1, 48, with_weights=True)
    tiles = []
    for tokens in (48, 80):  # the same tile height (32 rows), other grids
        x = mx.zeros((1, tokens, 128), mx.bfloat16)
        indices = mx.broadcast_to(mx.array([0, 1], mx.uint32), (1, tokens, 2))
        weights = mx.full((1, tokens, 2), 0.5, mx.bfloat16)
        PREFILL.moe_prefill_kernel(x, indices, case.experts, weights)
        tiles.append(PREFILL.grid_tiles(indices.size, 8, PREFILL.tile_height(indices.size, 8)))
    assert built == ["first", "last"]  # once per stage of the layer at this tile height
    first_call, last_call, first_again, last_again = recorders["grouped"].calls
    for call, again in ((first_call, first_again), (last_call, last_again)):
        # the weights, placeholders, dims and params: the same objects at every call of the layer
        assert all(a is b for a, b in zip(call["inputs"][3:], again["inputs"][3:])) and len(call["inputs"]) == 14
        assert call["template"] == again["template"]
    assert [c["grid"][1] for c in (first_call, first_again)] == tiles and tiles[0] != tiles[1]
    assert dict(first_call["template"])["ACTIVATE"] and dict(first_call["template"])["PAIRS_IN"]
    assert not dict(last_call["template"])["ACTIVATE"] and not dict(last_call["template"])["PAIRS_IN"]
    tile = dict(first_call["template"])["BM"]
    assert first_call["output_shapes"] == [(tiles[0] * tile, 256)] and last_call["output_shapes"] == [(48 * 2, 128)]
    assert len(recorders["combine"].calls) == 2
