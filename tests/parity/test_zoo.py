"""The model zoo itself: every family builds, decodes non-degenerately and
deterministically, and really routes through quantized switch layers."""

import importlib

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_moe_fix import zoo

BITS = (4, 8)
N_TOKENS = 32


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_build_greedy_distinct_and_deterministic(family, bits):
    prompt = zoo.prompt_for(family)
    tokens = zoo.greedy_tokens(zoo.build(family, bits, seed=0), prompt, N_TOKENS)
    assert len(tokens) == N_TOKENS
    assert len(set(tokens)) >= 4, f"degenerate greedy stream: {tokens}"

    again = zoo.greedy_tokens(zoo.build(family, bits, seed=0), prompt, N_TOKENS)
    assert again == tokens, "same seed must give the same weights and tokens"


def _quantized_switch_linear_classes():
    classes = [importlib.import_module("mlx_lm.models.switch_layers").QuantizedSwitchLinear]
    vlm = importlib.import_module("mlx_vlm.models.switch_layers")
    if vlm.QuantizedSwitchLinear not in classes:
        classes.append(vlm.QuantizedSwitchLinear)
    return classes


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_moe_layers_are_quantized_and_take_both_branches(family, monkeypatch):
    model = zoo.build(family, 4)
    layers = zoo.moe_layers(model)
    assert len(layers) == 2, [p for p, _ in layers]
    classes = tuple(_quantized_switch_linear_classes())
    for path, layer in layers:
        for name in ("gate_proj", "up_proj", "down_proj"):
            proj = layer[name]
            assert isinstance(proj, classes), f"{path}.{name} is {type(proj).__name__}"
            assert (proj.mode, proj.group_size, proj.bits) == ("affine", zoo.GROUP_SIZE, 4)

    if family == "inkling":
        for _, layer in layers:
            assert not layer.scales_trivial(), "inkling gate_scale/out_scale must be non-trivial"
        for path, m in model.named_modules():
            if type(m).__name__ == "InklingSparseMoE":
                assert bool((m.e_score_correction_bias != 0).any())

    # Spy on the expert matmuls: prefill must take SwitchGLU's sorted branch
    # (indices.size >= 64), decode the unsorted one.
    calls = []
    for cls in classes:
        original = cls.__call__

        def spy(self, x, indices, sorted_indices=False, _original=original):
            calls.append((indices.size, bool(sorted_indices)))
            return _original(self, x, indices, sorted_indices=sorted_indices)

        monkeypatch.setattr(cls, "__call__", spy)

    prompt = zoo.prompt_for(family)
    zoo.greedy_tokens(model, prompt, 3)
    num_experts, top_k = zoo.EXPERTS[family]
    prefill = [c for c in calls if c[1]]
    decode = [c for c in calls if not c[1]]
    # 3 projections x 2 layers, once for prefill and once per decoded token
    assert len(prefill) == 6 and all(size == len(prompt) * top_k >= 64 for size, _ in prefill)
    assert len(decode) == 12 and all(size == top_k < 64 for size, _ in decode)


def test_families():
    assert set(zoo.EXPERTS) == set(zoo.FAMILIES)
    assert any(e == k for e, k in zoo.EXPERTS.values()), "want one family with top_k == num_experts"
    assert all(k >= 2 for _, k in zoo.EXPERTS.values())


@pytest.mark.parametrize("family", ["mixtral", "inkling"])
def test_seed_changes_weights(family):
    prompt = zoo.prompt_for(family)
    a = zoo.greedy_tokens(zoo.build(family, 8, seed=0), prompt, 8)
    b = zoo.greedy_tokens(zoo.build(family, 8, seed=1), prompt, 8)
    assert a != b


def test_recording_routes_sees_every_layer_call_and_restores_the_layers():
    model = zoo.build("qwen3_moe", 4)
    layers = zoo.moe_layers(model)
    classes = [type(layer) for _, layer in layers]
    prompt = zoo.prompt_for("qwen3_moe")
    with zoo.recording_routes(model) as first:
        tokens = zoo.greedy_tokens(model, prompt, 3)
    with zoo.recording_routes(model) as second:
        zoo.forced_decode(model, prompt, tokens)
    assert [type(layer) for _, layer in layers] == classes
    assert len(first) == 3 * len(layers)
    assert first[0].experts.shape == (1, len(prompt), zoo.EXPERTS["qwen3_moe"][1]) and first[0].weights is None
    assert all(route.picks == () for route in first)  # full attention and a plain router: nothing to pick
    assert zoo.rerouted_steps(first, second, 3) == [False] * 3
    moved = list(first)
    moved[len(layers)] = moved[len(layers)]._replace(experts=moved[len(layers)].experts + 1)  # layer 0, first decode step
    assert zoo.rerouted_steps(moved, first, 3) == [False, True, False]
    with pytest.raises(ValueError):
        zoo.rerouted_steps(first[:-1], second, 3)
    with pytest.raises(ValueError):
        zoo.rerouted_steps(first, second, 4)


def test_recording_routes_sees_phimoe_weights_and_their_jumps():
    model = zoo.build("phimoe", 4)
    layers = len(zoo.moe_layers(model))
    prompt = zoo.prompt_for("phimoe")
    with zoo.recording_routes(model) as routes:
        zoo.greedy_tokens(model, prompt, 2)
    assert all(r.weights is not None and r.weights.shape == r.experts.shape for r in routes)
    assert zoo.rerouted_steps(routes, routes, 2) == [False, False]
    nudged = [r._replace(weights=r.weights * (1 + zoo.REWEIGHTED / 2)) for r in routes]
    assert zoo.rerouted_steps(nudged, routes, 2) == [False, False]
    jumped = list(routes)
    jumped[layers] = jumped[layers]._replace(weights=jumped[layers].weights * (1 + 2 * zoo.REWEIGHTED))
    assert zoo.rerouted_steps(jumped, routes, 2) == [False, True]
    import mlx_lm.models.phimoe as phimoe

    assert phimoe.sparsemixer.__name__ == "sparsemixer"  # put back


def test_rerouted_steps_by_row_tells_which_rows_moved():
    same = zoo.Route(mx.array([[[0, 1]], [[2, 3]]]))
    moved = zoo.Route(mx.array([[[0, 1]], [[2, 4]]]))
    assert zoo.rerouted_steps([same, moved], [same, same], 2, by_row=True) == [[False, False], [False, True]]
    assert zoo.rerouted_steps([same, moved], [same, same], 2) == [False, True]


# Projections whose input `model.shard(group)` splits across the ranks (upstream's "sharded-to-all"
# attention output, and the in-place sharded experts' down projection).
INPUT_SHARDED = ("o_proj", "down_proj")


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_no_quantized_projection_takes_a_64_wide_input_sharded_or_not(family):
    # zoo.K64_NOTE: MLX 0.32.4's CUDA quantized_matmul is wrong for one quantization group per row
    ranks = 2 if family in zoo.SHARDED_FAMILIES else 1
    model = zoo.build(family, 4)
    widths = {}
    for name, module in model.named_modules():
        if hasattr(module, "bits") and hasattr(module, "scales") and "embed" not in name:
            width = module.weight.shape[-1] * 32 // module.bits
            widths[name] = width // ranks if name.endswith(INPUT_SHARDED) else width
    assert widths and min(widths.values()) > zoo.GROUP_SIZE, {n: w for n, w in widths.items() if w <= zoo.GROUP_SIZE}


def test_recording_routes_sees_mlx_vlm_phimoe_weights():
    # mlx-vlm's phimoe has its own copy of the sparsemixer: without its weights a jump there
    # (a gate crossing the jitter band) would read as a kernel's error on a GPU
    model = zoo.build("phimoe_vlm", 4)
    with zoo.recording_routes(model) as routes:
        zoo.greedy_tokens(model, zoo.prompt_for("phimoe_vlm"), 2)
    assert routes and all(r.weights is not None and r.weights.shape == r.experts.shape for r in routes)


def test_rerouted_steps_counts_forwards_where_a_forward_skips_some_moe_layers():
    # ernie4_5_moe_vl's vision experts are MoE layers that a text prompt's forwards never call
    model = zoo.build("ernie4_5_moe_vl_vlm", 4)
    with zoo.recording_routes(model) as routes:
        zoo.greedy_tokens(model, zoo.prompt_for("ernie4_5_moe_vl_vlm"), 3)
    assert len(routes) < 3 * len(zoo.moe_layers(model))
    assert zoo.rerouted_steps(routes, routes, 3) == [False] * 3


def test_observed_rerouted_steps_reads_the_decode_calls_and_refuses_what_it_cannot_see():
    # 3 forwards of 2 MoE layers: a 4-token prefill, then 2 decode steps of 1 token, top-2
    prefill = [zoo.Route(mx.array([[[0, 1], [2, 3], [1, 2], [0, 3]]]))] * 2
    decode = [zoo.Route(mx.array([[[1, 4]]])), zoo.Route(mx.array([[[0, 2]]]))] * 2
    routes = prefill + decode
    observed = [mx.array([4, 1], mx.uint32), mx.array([2, 0], mx.uint32)] * 2  # a launch's own order and shape
    assert zoo.observed_rerouted_steps(observed, routes, 3) == [False, False]
    moved = observed[:3] + [mx.array([2, 5], mx.uint32)]
    assert zoo.observed_rerouted_steps(moved, routes, 3) == [False, True]
    assert zoo.observed_rerouted_steps(observed[:3], routes, 3) is None  # a decode call routed elsewhere
    assert zoo.observed_rerouted_steps(observed + observed[:2], routes, 3) is None  # a prefill call too
    assert zoo.observed_rerouted_steps([mx.array([1, 4, 0], mx.uint32)] + observed[1:], routes, 3) is None
    picked = routes[:-1] + [routes[-1]._replace(picks=((mx.array([0]), mx.array(1)),))]
    assert zoo.observed_rerouted_steps(observed, picked, 3) is None
    weighed = routes[:2] + [routes[2]._replace(weights=mx.array([[[0.5, 0.5]]]))] + routes[3:]
    assert zoo.observed_rerouted_steps(observed, weighed, 3) is None


@pytest.mark.parametrize("family", ["qwen4_exp_vlm", "longcat_flash", "longcat_flash_sparse_vlm", "minimax_m3_vl"])
def test_recording_routes_sees_the_top_k_picks_the_routes_hide_and_their_moves(family):
    model = zoo.build(family, 4)
    prompt = zoo.prompt_for(family)
    with zoo.recording_routes(model) as routes:
        zoo.greedy_tokens(model, prompt, 3)
    assert mx.argpartition.__name__ == "argpartition"  # put back
    picks = [pick for route in routes for pick in route.picks]
    # a pick per sparse layer (or LongCat-Flash's router) and forward: the indices below kth, the one at kth
    assert len(picks) >= 3 and all(below.ndim == at.ndim + 1 for below, at in picks)
    assert zoo.rerouted_steps(routes, routes, 3) == [False] * 3
    last = len(routes) - 1
    below, at = routes[last].picks[-1]
    moved = list(routes)
    moved[last] = moved[last]._replace(picks=moved[last].picks[:-1] + ((below, at + 1),))
    assert zoo.rerouted_steps(moved, routes, 3) == [False, False, True]


def test_longcat_flash_routes_hide_a_zero_expert_pick():
    # its router's zero (identity) experts reach the SwitchGLU as expert 0 at weight 0: the picks
    # tell a token sent to a zero expert from one sent to expert 0, its indices do not
    model = zoo.build("longcat_flash", 4)
    n_routed = model.args.n_routed_experts
    with zoo.recording_routes(model) as routes:
        zoo.greedy_tokens(model, zoo.prompt_for("longcat_flash"), 2)
    hidden = 0
    for route in routes:
        below, _ = route.picks[-1]  # the router's last: the experts it did not pick, below its kth
        total = below.shape[-1] + route.experts.shape[-1]
        for unpicked, experts in zip(below.reshape(-1, below.shape[-1]).tolist(),
                                     route.experts.reshape(-1, route.experts.shape[-1]).tolist()):
            picked = set(range(total)) - set(unpicked)
            assert len(picked) == len(experts)
            if any(e >= n_routed for e in picked):
                assert 0 in experts  # the zero expert, as the switch layer sees it
                hidden += 1
    assert hidden > 0, "no token picked a zero expert: the case proves nothing"


def pick_after(h):
    return mx.argpartition(h, kth=-2, axis=-1)[..., -2:]


class PicksAfterItsMoE(nn.Module):
    """A model whose top-k pick (pick_after) runs after its MoE layer, as an attention after the
    MoE block would."""

    def __init__(self):
        super().__init__()
        from mlx_lm.models.switch_layers import SwitchGLU

        self.moe = SwitchGLU(8, 16, 4)

    def __call__(self, x):
        h = self.moe(x, mx.array([[[0, 1]]], mx.uint32))
        pick_after(h)
        return h


def test_recording_routes_gives_each_forward_its_own_picks(monkeypatch):
    # the picks after a forward's last MoE layer call are that forward's, not the next one's
    # (where a move would excuse the wrong step); the model's own calls mark the forwards
    monkeypatch.setitem(zoo.TOP_K_PICKERS, __name__, {"pick_after"})
    model = PicksAfterItsMoE()
    with zoo.recording_routes(model) as routes:
        for _ in range(3):
            model(mx.ones((1, 1, 8)))
    assert [len(route.picks) for route in routes] == [1, 1, 1]
