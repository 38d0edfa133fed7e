"""Breadth: every further MoE family of mlx_moe_fix.zoo_breadth (mlx-lm's, and mlx-vlm's language
models), built small from its own classes, keeps stock's greedy tokens with the package applied
(tests/parity/test_greedy_tokens.py's check: identical where the references run, teacher-forced
where kernels do), and its SwitchGLU or SwitchMLP calls (where a family calls its switch linears
itself, their switch linears') went through the ops in both phases, not upstream's code. On a GPU
(kernels, bf16; MLX compiles stock's kernels per shape for each of the 99 models)
scripts/gpu-check.sh runs these apart: BREADTH=1. Every mlx-lm and mlx-vlm model that names a
switch layer is a zoo family or in zoo_breadth.LEFT_OUT with the reason."""

import importlib.metadata
import pathlib

import mlx_moe_fix
import pytest

from mlx_moe_fix import zoo, zoo_breadth

from .test_greedy_tokens import assert_greedy_tokens_match_stock, run_dtype


# The first expert projection of a SwitchGLU, a SwitchMLP, and the packed blocks (zoo.PACKED_SWITCH_GLUS).
FIRST_PROJECTIONS = ("gate_proj", "fc1", "gate_up_proj", "linear_fc1")


@pytest.mark.parametrize("family", zoo.BREADTH_FAMILIES)
def test_breadth_family_keeps_stock_tokens(device, family):
    dtype = run_dtype(device)
    model = zoo.build(family, 4, dtype=dtype)
    num_experts, top_k = zoo.BREADTH_FAMILIES[family].experts
    layers = zoo.moe_layers(model)
    first_projections = [next(layer[name] for name in FIRST_PROJECTIONS if name in layer) for _, layer in layers]
    assert first_projections and all(p.weight.shape[0] == num_experts for p in first_projections)
    assert_greedy_tokens_match_stock(model, family, dtype)
    ops = mlx_moe_fix.status()["ops"]
    layer_name = patched_layer_name(layers[0][1])
    paths = {(r.phase, r.path) for r in mlx_moe_fix.path_counts() if r.layer.split("[")[0] == layer_name}
    assert paths == {("prefill", ops["moe_prefill"]["path"]), ("decode", ops["moe_decode"]["path"])}, mlx_moe_fix.path_counts()


def patched_layer_name(layer) -> str:
    """The layer path_counts names for a MoE layer's patched calls (mlx-vlm's with "[vlm]" after):
    its class's where that class's __call__ is upstream's switch layer's (the patched one), and
    "QuantizedSwitchLinear" where the layer calls its switch linears itself (a packed block, or a
    SwitchGLU subclass with a __call__ of its own, as mlx-vlm's DeepseekV41SwitchGLU)."""
    owner = next(c for c in type(layer).__mro__ if "__call__" in vars(c))
    return owner.__name__ if owner.__module__.endswith("models.switch_layers") else "QuantizedSwitchLinear"


def test_every_upstream_moe_family_is_in_the_zoo_or_left_out_with_a_reason():
    covered = set(zoo.upstream_families())
    upstream = zoo_breadth.upstream_moe_models()
    assert len(upstream) > 50 and "mlx_lm.models.qwen3_moe" in upstream and "mlx_vlm.models.inkling" in upstream
    missing = upstream - covered - set(zoo_breadth.LEFT_OUT)
    installed = {name: importlib.metadata.version(name) for name in zoo_breadth.LEFT_OUT_CHECKED_AGAINST}
    if missing and installed != zoo_breadth.LEFT_OUT_CHECKED_AGAINST:
        # a new upstream release is no fault of this tree's: CI installs the newest
        pytest.skip(f"upstream {installed} is not the {zoo_breadth.LEFT_OUT_CHECKED_AGAINST} the zoo was checked "
                    f"against, and has MoE families neither in the zoo nor left out: {sorted(missing)}")
    assert not missing, f"upstream MoE families with neither a zoo family nor a reason in zoo_breadth.LEFT_OUT: {sorted(missing)}"
    assert not set(zoo_breadth.LEFT_OUT) & covered, "a family both covered and left out"
    assert set(zoo_breadth.LEFT_OUT) <= upstream, "a left-out family upstream no longer has"



def test_the_families_page_lists_every_upstream_moe_model():
    installed = {name: importlib.metadata.version(name) for name in zoo_breadth.LEFT_OUT_CHECKED_AGAINST}
    if installed != zoo_breadth.LEFT_OUT_CHECKED_AGAINST:
        pytest.skip(f"upstream {installed} is not the {zoo_breadth.LEFT_OUT_CHECKED_AGAINST} docs/families.md lists")
    page = (pathlib.Path(__file__).parents[2] / "docs" / "families.md").read_text()
    assert page == zoo.families_markdown(), (
        "docs/families.md is out of date: python -c 'from mlx_moe_fix import zoo; print(zoo.families_markdown(), end=\"\")' "
        "> docs/families.md")
