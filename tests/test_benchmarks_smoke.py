"""The benchmark scripts run end to end at tiny sizes on the CPU and write the JSON that
scripts/gpu-check.sh reads. Their real runs happen on the GPU machine; this keeps them from
rotting between those runs. They run on the CPU also on a GPU machine, as children
(MLX_MOE_FIX_BENCH_CPU=1) and in this process (MLX's CUDA quantized_matmul has no kernel for some of
their tiny shapes, and their checks are of the references).

    python3 -m pytest tests/test_benchmarks_smoke.py -q
"""

import contextlib
import io
import json
import os
import re
import subprocess
import sys

import pytest

from tests.subprocess_env import REPO, repo_env

CHILD_ENV = repo_env(MLX_MOE_FIX_BENCH_CPU="1")

# the benchmarks called in this process run on the CPU too
pytestmark = pytest.mark.usefixtures("cpu_device")


def run_module(module: str, *args: str) -> str:
    """`python3 -m <module> <args>` from the repo root, as gpu-check.sh runs it."""
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"{module} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Both smoke runs once for the tests below: {name: (json path, stdout)}."""
    directory = tmp_path_factory.mktemp("bench")
    runs = {}
    for name in ("kernels", "models"):
        path = str(directory / f"{name}.json")
        runs[name] = (path, run_module(f"benchmarks.{name}", "--smoke", "--json", path))
    return runs


def load(outputs, name):
    with open(outputs[name][0]) as f:
        return json.load(f)


def test_kernels_smoke_writes_every_case(outputs):
    result = load(outputs, "kernels")
    assert {"env", "mlx_moe_fix_status", "config", "results", "blocks"} <= set(result)
    # T = 1 and 4 run as chained decode layers, T = 64 as prefill; blocks at the same sizes.
    assert [(r["tokens"], r["mode"]) for r in result["results"]] == [
        (1, "decode"),
        (4, "decode"),
        (64, "prefill"),
    ]
    assert len(result["blocks"]) == 3
    for case in result["results"] + result["blocks"]:
        stock, ours = case["methods"][case["stock_method"]], case["methods"][case["ours_method"]]
        assert stock["median_s"] > 0 and ours["median_s"] > 0
        assert case["speedup"] > 0
        assert all(err < 2e-2 for err in case["rel_err"].values())
    assert "Expert projection, prefill" in outputs["kernels"][1]


def test_models_smoke_writes_every_model(outputs):
    result = load(outputs, "models")
    assert {"env", "mlx_moe_fix_status", "config", "models", "summary"} <= set(result)
    moe = ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "inkling", "deepseek_v4"]
    dense = ["qwen3_dense", "llama_dense", "gpt_oss_dense", "deepseek_v3_dense", "inkling_dense", "deepseek_v4_dense"]
    unbatched = {"inkling", "deepseek_v4"}  # mlx-vlm caches: no BatchGenerator
    assert set(result["models"]) == set(moe + dense)
    for name in moe:
        model = result["models"][name]
        assert set(model["modes"]) == {"stock", "patched"}
        for mode in model["modes"].values():
            assert set(mode["prefill"]) == {"16", "40"}
            assert mode["decode"]["best"] > 0
            assert set(mode["batch_decode"]) == (set() if name in unbatched else {"1", "2"})
        assert model["parity"]["tokens_compared"] == 8
        # On the CPU the ops run their references: stock's own math, so the same tokens.
        assert model["parity"]["identical"], name
    for name in dense:
        assert set(result["models"][name]["modes"]) == {"stock"}
    # 4 MoE models x (2 prefill lengths + decode + 2 batch sizes) and 2 x (2 prefill lengths +
    # decode), each with its dense ratio.
    assert len(result["summary"]) == 4 * 5 + 2 * 3
    assert all(row["patched_over_dense"] for row in result["summary"])
    assert "| qwen3_moe" in outputs["models"][1]


def test_summary_reads_both(outputs, tmp_path):
    log = tmp_path / "tests.log"
    log.write_text("---- shard 0/1 (exit 0)\n...\n3 passed in 1.00s\nshard 0/1: 3 passed in 1.00s\n")
    text = run_module(
        "benchmarks.summary",
        "--tests",
        str(log),
        "--kernels",
        outputs["kernels"][0],
        "--models",
        outputs["models"][0],
    )
    assert "parity tests: shard 0/1: 3 passed in 1.00s" in text
    assert "| tiny" in text and "| deepseek_v3" in text


def test_summary_says_a_cut_short_tests_log_is_incomplete(tmp_path):
    from benchmarks.summary import tests_line

    # what gpu-check.sh's SIGKILL left at the ninety-second stop: shard 0's log, no closing line
    log = tmp_path / "tests.log"
    log.write_text("---- shard 0/8 (exit 2)\n......\n6 passed, 607 deselected in 225.02s (0:03:45)\n")
    assert tests_line(str(log)).startswith("INCOMPLETE")
    assert "6 passed, 607 deselected" in tests_line(str(log))


def test_decode_split_smoke_prints_its_table():
    out = run_module(
        "benchmarks.decode_split", "--hidden", "128", "--ffn", "64", "--experts", "8", "--top-k", "2",
        "--layers", "2", "--reps", "2",
    )
    assert "| stock SwitchGLU |" in out and "| patched SwitchGLU |" in out
    assert "max relative error over layers: 0.00e+00" in out  # CPU: the reference is stock's math


@pytest.mark.parametrize("family, rows", [("qwen3_moe", 5), ("mixtral", 5), ("deepseek_v4", 4), ("inkling", 4)])
def test_decode_blocks_smoke_prints_every_row(family, rows):
    # mlx-vlm's blocks keep their own routing: no row with the routing apart
    out = run_module("benchmarks.decode_blocks", "--family", family, "--layers", "2", "--reps", "2", "--scale", "32")
    printed = [line for line in out.splitlines() if line.startswith("| MoE block") or line.startswith("| dense")]
    assert len(printed) == rows, out


def test_decode_blocks_times_the_compiled_step_and_mlx_compiled_call_apart(monkeypatch, capsys):
    # compiled steps are CUDA's only; here the CPU takes them (their references traced)
    from benchmarks import decode_blocks
    from mlx_moe_fix.patches import compiled

    monkeypatch.setattr(compiled, "BACKENDS", ("cpu",))
    decode_blocks.main(["--layers", "2", "--reps", "2", "--scale", "32"])
    rows = [line.split("|")[1].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert "the compiled step alone (no wrapper)" in rows and "a compiled x * 2 with each step's captured inputs" in rows, rows


def test_decode_graph_patched_adds_no_primitives_to_a_decode_step():
    """The patched layers' default path (the references) asks MLX for no more work per decode
    token than stock: a fused-activation regression (7 more primitives per gpt-oss layer before
    the references compiled their activations) shows up here as a row mismatch."""
    table = run_module("benchmarks.decode_graph")
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[1] in ("stock", "patched"):
            rows[(cells[0], cells[1])] = cells[2:]
    moe = {"qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"}
    assert {name for name, _ in rows} >= moe
    for name in moe:
        assert rows[(name, "patched")][0] == rows[(name, "stock")][0], (name, rows)
        assert float(rows[(name, "stock")][0]) > 0


def test_decode_attribution_smoke_times_every_variant(tmp_path):
    path = str(tmp_path / "attribution.json")
    table = run_module("benchmarks.decode_attribution", "--smoke", "--models", "qwen3_moe", "--json", path)
    with open(path) as f:
        seconds = json.load(f)["seconds_per_token"]["qwen3_moe"]
    assert set(seconds["qwen3_moe"]) == {"full", "patched", "no experts", "no MoE"}
    assert set(seconds["qwen3_dense"]) == {"full", "no MLP"}
    assert all(s > 0 for variant in seconds.values() for s in variant.values())
    assert "routing + combine" in table


def test_sharded_layers_runs_on_one_rank():
    out = run_module("benchmarks.sharded_layers", "--hidden", "128", "--ffn", "256", "--experts", "4",
                     "--layers", "2", "--tokens", "16", "--reps", "2")
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ranks"] == 1 and set(result["results"]) == {"stock", "patched"}
    assert all(r["tokens_per_s"] > 0 for r in result["results"].values())


def test_stock_reproducibility_finds_nothing_on_the_cpu():
    out = run_module("benchmarks.stock_reproducibility", "--families", "mixtral")
    row = [line for line in out.splitlines() if line.startswith("| mixtral-4")][-1]
    assert "0.00e+00" in row and "none: every module call identical" in row


def test_stock_qmm_probe_finds_the_cpu_consistent():
    """On the CPU both sides run the same kernel: every row exact and reproducible."""
    out = run_module("benchmarks.stock_qmm_probe")
    rows = [line for line in out.splitlines() if line.startswith("| quantized_matmul") or line.startswith("| gather_qmm")]
    assert len(rows) == 16
    assert all(line.count("0.00e+00") == 2 for line in rows), out


@pytest.mark.parametrize("model, variants, callers", [("qwen3_moe", 5, 2), ("deepseek_v4", 4, 1)])
def test_single_stream_smoke_prints_every_variant_per_caller(model, variants, callers):
    # deepseek_v4: no routing inside the decode kernel, no BatchGenerator
    out = run_module("benchmarks.single_stream", "--smoke", "--model", model)
    rows = [line for line in out.splitlines() if line.startswith(("| stock", "| patched", "| dense"))]
    assert len(rows) == variants * callers and all(len(line.split("|")) == 6 for line in rows), out
    assert all(line.split("|")[-2].strip() == "1.000" for line in rows if line.startswith("| dense")), out


def test_single_stream_runs_only_the_variants_and_callers_asked_for():
    out = run_module("benchmarks.single_stream", "--smoke", "--variants", "patched", "--callers", "generate_step")
    rows = [line for line in out.splitlines() if line.startswith("| ")][1:]
    assert [line.split("|")[1].strip() for line in rows] == ["patched", "dense equivalent"], out
    assert "BatchGenerator" not in out


@pytest.mark.parametrize("model", ["qwen3_moe", "deepseek_v4"])
def test_decode_timeline_splits_each_variants_token_into_its_host_phases(model):
    out = run_module("benchmarks.decode_timeline", "--smoke", "--model", model)
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith(("| stock", "| patched", "| dense"))}
    assert list(rows) == ["stock", "patched", "dense equivalent"], out
    for build, submit, wait, token, per_layer, tok_s, versus in rows.values():
        assert float(build) > 0 and float(submit) > 0 and float(wait) >= 0 and float(tok_s) > 0
        # the token's median is of the tokens' sums, each the sum of its three phases
        assert float(token) > 0 and abs(float(per_layer) * 2 - float(token)) <= 1  # the smoke models' 2 layers
    assert rows["dense equivalent"][-1] == "1.000"


def test_batched_timeline_gives_each_variant_and_batch_size_its_own_generator_in_its_mode(monkeypatch):
    import mlx_moe_fix
    from benchmarks import batched_timeline, models

    seen = []
    burst = batched_timeline.BatchedDecoder.burst

    def recording_burst(self, steps):
        dense = self.generator.model.__class__.__module__.endswith(".qwen3")
        seen.append(("dense" if dense else "moe", mlx_moe_fix.is_applied(), self.batch))
        return burst(self, steps)

    monkeypatch.setattr(batched_timeline.BatchedDecoder, "burst", recording_burst)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        batched_timeline.main(["--smoke", "--batch-sizes", "2,1"])
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in out.getvalue().splitlines()
            if line.startswith(("| stock", "| patched", "| dense"))]
    assert [row[:2] for row in rows] == [[label, batch] for label in ("stock", "patched", "dense equivalent") for batch in ("1", "2")]
    for label, batch, step_ms, tok_s, versus_dense, versus_batch_1 in rows:
        assert float(step_ms) > 0 and float(tok_s) > 0
        assert versus_dense == "1.000" if label == "dense equivalent" else float(versus_dense) > 0
        assert versus_batch_1 == "1.000" if batch == "1" else float(versus_batch_1) > 0
    variants = [("moe", False, 1), ("moe", False, 2), ("moe", True, 1), ("moe", True, 2), ("dense", False, 1), ("dense", False, 2)]
    # the warm-ups, then two cycles of turns, the second starting one further on; stock after
    assert seen == variants + variants + variants[1:] + variants[:1] and not mlx_moe_fix.is_applied()
    with pytest.raises(SystemExit):
        batched_timeline.main(["--smoke", "--batch-sizes", "0"])
    with pytest.raises(SystemExit):  # a family whose caches BatchGenerator does not take
        batched_timeline.main(["--smoke", "--model", sorted(models.NO_BATCHED_DECODE & set(models.MOE_MODELS))[0]])


def test_decode_timeline_decodes_a_batch_of_sequences_a_step_and_counts_each_token(monkeypatch):
    from benchmarks import decode_timeline

    shapes = set()
    step = decode_timeline.Decoder.step
    monkeypatch.setattr(decode_timeline.Decoder, "step", lambda self, y: shapes.add(y.shape) or step(self, y))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        decode_timeline.main(["--smoke", "--batch", "3"])
    assert shapes == {(3,)}
    rows = [[cell.strip() for cell in line.split("|")[2:-1]] for line in out.getvalue().splitlines()
            if line.startswith(("| stock", "| patched", "| dense"))]
    assert len(rows) == 3 and "batch 3" in out.getvalue()
    for build, submit, wait, step_us, per_layer, tok_s, versus in rows:
        # tok/s: 3 tokens a step (medians of bursts against the median step: within 2x)
        assert 0.5 < float(tok_s) * float(step_us) / 3e6 < 2
    with pytest.raises(SystemExit):
        decode_timeline.main(["--smoke", "--batch", "0"])


def test_decode_timeline_runs_a_patched_variant_per_switch_setting_with_that_switch_set(monkeypatch):
    from benchmarks import decode_timeline
    from mlx_moe_fix import env

    seen = []
    burst = decode_timeline.Decoder.burst
    monkeypatch.setattr(decode_timeline.Decoder, "burst",
                        lambda self, tokens: seen.append(env.flag("MLX_MOE_FIX_CUDA_ROUTED_DECODE")) or burst(self, tokens))
    monkeypatch.delenv("MLX_MOE_FIX_CUDA_ROUTED_DECODE", raising=False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        decode_timeline.main(["--smoke", "--patched-with", "MLX_MOE_FIX_CUDA_ROUTED_DECODE=0"])
    labels = [line.split("|")[1].strip() for line in out.getvalue().splitlines() if line.startswith(("| stock", "| patched", "| dense"))]
    assert labels == ["stock", "patched", "dense equivalent", "patched, MLX_MOE_FIX_CUDA_ROUTED_DECODE=0"]
    # the warm-up and each cycle: the four variants in turn, only the fourth with the switch off, each
    # cycle's turn starting one variant further on; after, the switch at its default again
    assert seen == [True, True, True, False] * 2 + [True, True, False, True] and env.flag("MLX_MOE_FIX_CUDA_ROUTED_DECODE")
    with pytest.raises(SystemExit):
        decode_timeline.main(["--smoke", "--patched-with", "MLX_MOE_FIX_NOT_A_SWITCH=0"])


def test_compiled_step_variant_replays_a_step_of_two_arguments():
    """DeepSeek-V4's blocks take the token ids after x: compiled-step replays their two-argument
    step with both, and calls the block's own call where the last step does not fit the call."""
    import types

    import mlx.core as mx
    import mlx.nn as nn

    from benchmarks import decode_timeline
    from mlx_moe_fix.patches import compiled

    _, _, make = decode_timeline.block_variant("compiled-step", "deepseek_v4", {False: nn.Module()})
    step = make(lambda self, x, *args, **kwargs: ("own", len(args), sorted(kwargs)))
    x, ids = mx.zeros((1, 1, 8)), mx.zeros((1, 1), mx.int32)
    block = types.SimpleNamespace()
    setattr(block, compiled._LAST_STEP, types.SimpleNamespace(
        shape=x.shape, arity=2, step=lambda instance, args, kwargs: ("step", len(args), sorted(kwargs))))
    assert step(block, x, ids) == ("step", 2, [])
    assert step(block, x) == ("own", 0, [])  # one argument: not the last step's call
    assert step(block, x, ids, residual=None) == ("own", 1, ["residual"])
    assert step(block, mx.zeros((1, 2, 8)), ids) == ("own", 1, [])


def test_decode_timeline_swaps_each_block_variants_call_for_its_bursts_only(monkeypatch):
    # On the CPU the decode launches are the reference's (same contract); the compiled step is
    # absent there, so compiled-step falls back to the patched call.
    from mlx_lm.models import qwen3, qwen3_moe

    from benchmarks import decode_timeline

    moe_routed_decode = sys.modules["mlx_moe_fix.kernels.moe_routed_decode"]  # the package's name is the dispatcher's
    calls = {"kernel": 0}
    reference = moe_routed_decode.moe_routed_decode_reference
    monkeypatch.setattr(moe_routed_decode, "moe_routed_decode_kernel",
                        lambda *a: calls.__setitem__("kernel", calls["kernel"] + 1) or reference(*a))
    burst = decode_timeline.Decoder.burst
    swapped_in = []

    def own_calls():  # upstream's, patched or not (a patched method's __wrapped__ is upstream's)
        return tuple(getattr(call, "__wrapped__", call)
                     for call in (qwen3_moe.Qwen3MoeSparseMoeBlock.__dict__["__call__"], qwen3.MLP.__dict__["__call__"]))

    def recording_burst(self, tokens):
        swapped_in.append(own_calls())
        return burst(self, tokens)

    monkeypatch.setattr(decode_timeline.Decoder, "burst", recording_burst)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        decode_timeline.main(["--smoke", *[f"--block-variant={v}" for v in decode_timeline.BLOCK_VARIANTS]])
    labels = [line.split("|")[1].strip() for line in out.getvalue().splitlines() if line.startswith(("| stock", "| patched", "| dense"))]
    assert labels == ["stock", "patched", "dense equivalent", "patched, moe-identity", "dense equivalent, dense-identity",
                      "patched, compiled-step", "patched, eager-kernels", "patched, fixed-logits",
                      "patched, shared-launches", "patched, layer-launches", "patched, tree-launches"]
    # warm-up and the smoke's two cycles (the second's turn starting one variant further on): each
    # burst ran with its own variant's calls, and every call is restored after
    production = swapped_in[0]
    assert len(swapped_in) == 3 * 11
    for bursts in (swapped_in[:11], swapped_in[11:22], swapped_in[32:] + swapped_in[22:32]):
        assert [b == production for b in bursts] == [True] * 3 + [False] * 8
        assert bursts[3][1] is production[1] and bursts[4][0] is production[0]  # one class swapped at a time
    assert own_calls() == production
    assert calls["kernel"] > 0  # the eager variants' decode steps went to the (stand-in) kernel
    with pytest.raises(SystemExit):  # no moe_routed_decode for DeepSeek-V4's blocks
        decode_timeline.main(["--smoke", "--model", "deepseek_v4", "--block-variant", "eager-kernels"])


def test_decode_timeline_block_variants_restore_an_inherited_call():
    # DeepSeek-V4's MoE block inherits its __call__ (its decoder block names it, and the dense
    # equivalent's MLP, `ffn`): the identities swap both in for their bursts, and the block inherits again after.
    from mlx_vlm.models.deepseek_v4 import language

    from benchmarks import decode_timeline

    assert "__call__" not in language.DeepseekV4MoE.__dict__
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        decode_timeline.main(["--smoke", "--model", "deepseek_v4", "--block-variant", "moe-identity",
                              "--block-variant", "dense-identity"])
    rows = {line.split("|")[1].strip(): line for line in out.getvalue().splitlines() if line.startswith(("| patched", "| dense"))}
    assert {"patched, moe-identity", "dense equivalent, dense-identity"} <= set(rows), out.getvalue()
    assert "__call__" not in language.DeepseekV4MoE.__dict__


def test_benchmark_models_are_built_for_inference_as_the_loaders_leave_them():
    # mlx-lm's and mlx-vlm's loaders call model.eval(); a model left training routes DeepSeek-V4's
    # gates through upstream's ops, which the patch never replaces (the forty-fifth session's
    # finding: every DeepSeek-V4 benchmark reading before it had no router kernel of ours).
    import mlx.core as mx

    from benchmarks import models
    from mlx_moe_fix.patches.moe_blocks import deepseek_v4_routing

    spec = models.model_specs(True, 2)["deepseek_v4"]
    model = models.build_model(spec)
    assert not any(module.training for _, module in model.named_modules())
    gates = [module for _, module in model.named_modules() if type(module).__name__ == "MoEGate"]
    one_token = mx.zeros((1, 1, spec.config["hidden_size"]), mx.bfloat16)
    assert gates and all(deepseek_v4_routing(gate, one_token) is not None for gate in gates)


def test_benchmark_models_shipped_quantization_is_each_checkpoints():
    # --experts-mode shipped: gpt_oss's and inkling's routed experts as their checkpoints ship them,
    # deepseek_v4 and its dense equivalent by DeepSeek-V4's own predicate (mlx-vlm's convert):
    # mxfp4 routed experts, mxfp8 shared experts and attention, the rest this benchmark's affine.
    from collections import Counter

    from benchmarks import models

    args = models.parse_args(["--smoke", "--experts-mode", "shipped"])
    _, _, specs = models.start_run(args, "test")
    assert {name: spec.experts_mode for name, spec in specs.items() if spec.experts_mode != "affine"} == {
        "gpt_oss": "mxfp4", "inkling": "nvfp4", "deepseek_v4": models.OWN, "deepseek_v4_dense": models.OWN}

    def quantizations(name):
        kinds = Counter()
        for path, module in models.build_model(specs[name]).named_modules():
            if "scales" in module:
                kind = ("routed" if ".switch_mlp." in path else "shared" if ".shared_experts." in path
                        else "attention" if ".attn." in path else "other")
                kinds[kind, module.mode, module.bits] += 1
        return {kind: count for kind, count in kinds.items()}

    moe, dense = quantizations("deepseek_v4"), quantizations("deepseek_v4_dense")
    assert {kind for kind in moe} == {("routed", "mxfp4", 4), ("shared", "mxfp8", 8), ("attention", "mxfp8", 8),
                                      ("other", "affine", 4)}
    assert {kind for kind in dense} == {("attention", "mxfp8", 8), ("other", "affine", 4)}
    assert moe["attention", "mxfp8", 8] == dense["attention", "mxfp8", 8]
    assert {mode for (kind, mode, _) in quantizations("inkling") if kind == "routed"} == {"nvfp4"}


def test_block_shapes_parse_and_set_the_decode_launches_block_shapes():
    import mlx.core as mx

    from benchmarks import block_shapes

    decode = block_shapes.decode_module
    shapes = block_shapes.parse("gate_up=4x2x24,one_pair_down=8x4x16")
    assert shapes == {"GATE_UP_BLOCK": decode.BlockShape(4, 2, 24), "ONE_PAIR_A_WARP_DOWN": decode.BlockShape(8, 4, 16)}
    assert block_shapes.parse(block_shapes.label(shapes)) == shapes and block_shapes.label({}) == "production"
    for bad in ("gate=4x2x24", "gate_up=4x2", "gate_up=4x2x18", "down=0x4x16"):
        with pytest.raises(ValueError):
            block_shapes.parse(bad)
    # rows= / warps= (decode_ab, decode_ncu) on the gate+up's and the plain down's, resident= on all three
    varied = block_shapes.varied(rows=2, resident=24)
    assert varied["GATE_UP_BLOCK"] == decode.GATE_UP_BLOCK._replace(rows=2, resident=24)
    assert varied["DOWN_BLOCK"] == decode.DOWN_BLOCK._replace(rows=2, resident=24)
    assert varied["ONE_PAIR_A_WARP_DOWN"] == decode.ONE_PAIR_A_WARP_DOWN._replace(resident=24)
    production = decode.GATE_UP_BLOCK
    with block_shapes.block_shapes(shapes):
        assert decode.gate_up_block_shape() == decode.BlockShape(4, 2, 24)
        assert decode.down_block_shape(8, True, 4, mx.bfloat16, "cuda").rows == 4
    assert decode.gate_up_block_shape() is production


def test_prefill_forward_smoke_times_every_variant(tmp_path):
    path = str(tmp_path / "forward.json")
    out = run_module("benchmarks.prefill_forward", "--smoke", "--json", path)
    with open(path) as f:
        written = json.load(f)
    rows = written["rows"]
    assert [row[1] for row in rows] == ["MoE, patched (prefill compiled per shape)", "MoE, patched, built in Python",
                                        "MoE, patched, MLX_MOE_FIX_CUDA_PREFILL_WGMMA=0", "MoE, stock",
                                        "dense equivalent", "MoE, patched, without MoE blocks",
                                        "dense equivalent, without MLPs"]
    assert all(float(row[4]) > 0 for row in rows)
    assert rows[4][5] == "1.000 / 1.000" and rows[4][6] == "1.000"  # two rounds, each against itself
    # the smoke's one prompt length plus one token, the patched model first there, then plus two, the dense first
    first_builds = written["first_builds"]
    assert [row[:3] for row in first_builds] == [[41, "MoE, patched", "first"], [41, "dense equivalent", "second"],
                                                 [42, "MoE, patched", "second"], [42, "dense equivalent", "first"]]
    for at, calls in enumerate(first_builds):  # (build / eval) of three calls, then the first calls' ratio
        assert len(calls) == 7 and all(float(ms) > 0 for cell in calls[3:6] for ms in cell.split(" / "))
        assert float(calls[6]) > 0 and calls[6] == first_builds[at - at % 2][6]
    assert [re.sub(r"\d+ PTX compiled.*", "", line) for line in written["first_additions"]] == [
        "41 tokens, MoE, patched: ", "41 tokens, dense equivalent: ", "42 tokens, dense equivalent: ", "42 tokens, MoE, patched: "]
    # the CPU runs the references, whose calls are not compiled: the benchmark says so
    assert "prefill compiled per shape, patched: off (cpu: only the CUDA kernels' calls are compiled)" in out


def test_prefill_memory_gives_each_case_stock_and_patched_bytes(capsys):
    from benchmarks.prefill_memory import main

    main(["--cases", "small:64,small:512"])
    lines = capsys.readouterr().out.splitlines()
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    assert [row[:2] for row in rows] == [["small T=64", "reference"], ["small T=512", "reference"]]
    for row in rows:  # the CPU's patched calls run the reference: stock's graph, stock's bytes
        stock, patched, weights = float(row[2]), float(row[3]), float(row[6])
        assert stock > 0 and abs(patched - stock) <= 0.01 * stock and weights > 0
    assert float(rows[1][2]) > 4 * float(rows[0][2])  # a prefill's bytes grow with its tokens


def test_prefill_forward_names_the_kernels_a_first_call_added_to_the_caches(tmp_path):
    from benchmarks.prefill_forward import cache_additions, cache_files

    ptx, driver = tmp_path / "ptx", tmp_path / "driver"
    (ptx / "old.ptx").parent.mkdir()
    (ptx / "old.ptx").write_text("")
    before = {"MLX PTX": cache_files(ptx), "driver": cache_files(driver)}  # the driver's folder not yet made
    for name in ("new_b.ptx", "new_b.cu", "new_b.txt", "new_a.ptx"):
        (ptx / name).write_text("")
    (driver / "ab" / "cd").mkdir(parents=True)
    (driver / "ab" / "cd" / "entry").write_text("")
    after = {"MLX PTX": cache_files(ptx), "driver": cache_files(driver)}
    assert cache_additions(before, after) == "2 PTX compiled (new_a, new_b), 1 driver cache files"
    assert cache_additions(after, after) == "0 PTX compiled, 0 driver cache files"


def test_prefill_ab_compares_gate_up_rows_in_pair_order():
    # The route kernel places an expert's rows in atomic order, so two trees' gate+up outputs are
    # compared pair by pair, padding rows (-1) left out.
    import mlx.core as mx

    from benchmarks.prefill_ab import in_pair_order

    row_pair = mx.array([2, 0, -1, 1, -1, -1], dtype=mx.int32)
    rows = mx.arange(12).reshape(6, 2)
    assert in_pair_order(rows, row_pair, 3).tolist() == [[2, 3], [6, 7], [0, 1]]


def test_prefill_ab_reads_k_ordered_gate_up_rows_in_their_own_column_order():
    # the gate+up on wgmma writes its rows in wgmma_k_order for a down on wgmma; prefill_ab compares
    # them with another tree's (maybe plain) rows after undoing it
    import mlx.core as mx

    from benchmarks.prefill_ab import in_natural_columns
    from mlx_moe_fix.kernels.moe_prefill import wgmma_k_order
    rows = mx.arange(3 * 192).reshape(3, 192)
    assert not mx.array_equal(wgmma_k_order(rows), rows).item()
    assert mx.array_equal(in_natural_columns(wgmma_k_order(rows), wgmma_k_order), rows).item()


def test_prefill_ab_imports_the_other_tree_under_its_own_name(tmp_path):
    # The timing needs CUDA; the other tree's package must be its own: its Python and its
    # kernel sources, beside this tree's, not this tree's again.
    import shutil

    from benchmarks.prefill_ab import OTHER, load_other
    from benchmarks.switch_glu import experts_of
    from mlx_lm.models.switch_layers import SwitchGLU

    import mlx_moe_fix.kernels as this
    from mlx_moe_fix.kernels import sources

    tree = tmp_path / "tree"
    shutil.copytree(os.path.join(REPO, "mlx_moe_fix"), tree / "mlx_moe_fix")
    cuda = tree / "mlx_moe_fix" / "kernels" / "cuda" / "moe_prefill.cu"
    cuda.write_text(cuda.read_text().replace("constexpr int STAGES = 3;", "constexpr int STAGES = 4;"))
    into = tmp_path / "into"
    into.mkdir()
    try:
        other = load_other(str(tree), str(into))
        assert other.__name__ == f"{OTHER}.kernels" and other is not this
        other_prefill = sys.modules[f"{OTHER}.kernels.moe_prefill"]
        assert other_prefill is not sys.modules["mlx_moe_fix.kernels.moe_prefill"]
        assert str(into) in other_prefill.__file__
        other_sources = sys.modules[f"{OTHER}.kernels.sources"]
        assert "STAGES = 4;" in other_sources.sections("cuda", "moe_prefill.cu")["header"]
        assert "STAGES = 3;" in sources.sections("cuda", "moe_prefill.cu")["header"]
        layer = SwitchGLU(64, 64, 4)
        assert type(experts_of(layer, other)) is other.MoEExperts is not this.MoEExperts
    finally:
        sys.path.remove(str(into))
        for name in [n for n in sys.modules if n == OTHER or n.startswith(OTHER + ".")]:
            del sys.modules[name]
    with pytest.raises(SystemExit):
        load_other(str(tmp_path / "empty"), str(into))


def test_kernel_source_cost_weighs_each_kernel_as_compiled():
    # The timing needs CUDA; the sizes it prints are the sources' as cuda_kernel gets them.
    from benchmarks.kernel_source_cost import KERNELS, source_sizes
    from mlx_moe_fix.kernels.sources import sections

    rows = source_sizes()
    assert [row[0] for row in rows] == [f"{f} {s}" for f, s in KERNELS]
    assert all(float(compiled) < float(whole) for _, compiled, whole in rows)
    for filename, section in KERNELS:  # every section of the CUDA files that a launcher uses is listed
        assert section in sections("cuda", filename)
    import mlx.core as mx

    if not mx.cuda.is_available():
        done = subprocess.run([sys.executable, "-m", "benchmarks.kernel_source_cost"], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode != 0 and "run it on a CUDA GPU" in done.stderr


def test_record_launches_writes_every_case_s_launches(tmp_path):
    path = tmp_path / "launches.json"
    done = subprocess.run([sys.executable, "scripts/record_launches.py", str(path)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=CHILD_ENV)
    assert done.returncode == 0, done.stderr[-4000:]
    with open(path) as f:
        recorded = json.load(f)
    # 7 zoo families x 2 bits x (prompt, decode step), 12 direct prefill calls, 36 direct decode calls
    assert len(recorded) == 76 and all(recorded.values())
    grouped = [call for calls in recorded.values() for call in calls if call["kernel"][1] == "grouped"]
    assert grouped and all(len(call["inputs"]) == 14 and call["grid"][1] > 0 for call in grouped)
    sections = {case: [call["kernel"][1] for call in calls] for case, calls in recorded.items()}
    assert sections["direct decode top-8 4-bit mlx.core.bfloat16 routed"] == ["routed_gate_up", "routed_down"]
    assert sections["direct decode top-2 8-bit mlx.core.float32 weighted"] == ["gate_up", "down"]
    # Inkling's decode step: its routing, routed and shared experts in two launches a layer
    assert sections["inkling-4 decode"] == ["sigmoid_shared_gate_up", "routed_shared_down"] * 2
    # DeepSeek-V4's: the same two launches a layer, after its routing in one launch of moe_router
    # (its first layer's by token hash, its second's by its scores)
    assert sections["deepseek_v4-4 decode"] == ["sqrtsoftplus_hash", "shared_gate_up", "shared_down", "sqrtsoftplus_topk",
                                                "shared_gate_up", "shared_down"]
    # each kernel object's launch bounds: the one-pair-a-warp down's 8-warp blocks where it applies
    bounds = {case: [call["kernel"][5] for call in calls] for case, calls in recorded.items()}
    assert bounds["direct decode top-8 4-bit mlx.core.bfloat16 routed"] == [[128, 4], [256, 2]]
    assert bounds["direct decode top-8 8-bit mlx.core.bfloat16 routed"] == [[128, 4], [128, 4]]


def test_decode_ncu_runs_each_variant_and_checks_it():
    out = run_module("benchmarks.decode_ncu", "--smoke", "--variants", "routed,unrouted,routed:rows=2:warps=8:resident=16")
    checks = [line for line in out.splitlines() if line.startswith("check smoke")]
    assert [line.split(":")[0] for line in checks] == ["check smoke routed", "check smoke unrouted", "check smoke routed"]
    assert all(float(line.rsplit(" ", 1)[1]) < 0.05 for line in checks), out
    from benchmarks.decode_ncu import parse_variant

    assert parse_variant("routed:rows=2:resident=20") == ("routed", {"rows": 2, "resident": 20})
    with pytest.raises(ValueError, match="unknown setting"):
        parse_variant("routed:ahead=4")


def test_decode_ncu_table_takes_medians_after_each_kernels_first_call():
    from benchmarks.decode_ncu import table

    header = ('"ID","Kernel Name","Block Size","Grid Size","Metric Name","Metric Unit","Metric Value"\n')
    name = "custom_kernel_mlx_moe_fix_moe_decode_gate_up_smem0_lb128x4_0123456789ab_bfloat16_t_4_64(const float *)"

    def reading(i, grid, metric, value):
        return f'"{i}","{name}","(128, 1, 1)","{grid}","{metric}","ns","{value}"\n'

    text = "==PROF== noise\n" + header + "".join(
        reading(i, "(48, 8, 1)", "gpu__time_duration.sum", f"{t:,}") + reading(i, "(48, 8, 1)", "dram__bytes_read.sum", "14,000,000")
        for i, t in enumerate((90_000, 14_000, 12_000, 16_000))) + header + reading(9, "(96, 8, 1)", "gpu__time_duration.sum", "5,000")
    rows = table(text)
    assert [(label, grid) for label, grid, *_ in rows] == [
        ("moe_decode_gate_up_lb128x4 0123 bfloat16_t_4_64", "(48, 8, 1)(128, 1, 1)"),
        ("moe_decode_gate_up_lb128x4 0123 bfloat16_t_4_64", "(96, 8, 1)(128, 1, 1)")]
    assert rows[0][2] == 14.0 and rows[0][3] == 1.0 and rows[0][6] == 3  # the first call (90 µs) left out
    assert rows[1][2] == 5.0 and rows[1][6] == 1


def test_decode_ab_counts_the_bytes_of_each_distinct_routed_expert():
    # The timing needs CUDA; the bandwidth it reports rests on this count.
    import mlx.core as mx
    import mlx.nn as nn
    from benchmarks.decode_ab import expert_bytes
    from mlx_lm.models.switch_layers import SwitchGLU

    layer = SwitchGLU(128, 64, 8)
    nn.quantize(layer, group_size=64, bits=4)
    # an expert's three 64 x 128 projections: 4-bit values, and a float32 scale and bias per 64
    per_expert = 3 * (64 * 128 // 2 + 2 * 4 * 64 * 128 // 64)
    assert expert_bytes(layer, mx.array([[0, 3]], dtype=mx.uint32)) == 2 * per_expert
    assert expert_bytes(layer, mx.array([[5, 5], [5, 1]], dtype=mx.uint32)) == 2 * per_expert


def test_decode_ab_wants_cuda():
    import mlx.core as mx

    if mx.cuda.is_available():
        pytest.skip("MLX sees CUDA here: decode_ab would run its benchmark")
    done = subprocess.run([sys.executable, "-m", "benchmarks.decode_ab", "--other", REPO], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "run it on a CUDA GPU" in done.stderr


def test_decode_roofline_counts_the_bytes_its_kernel_is_given():
    # The TB/s it reports rest on this count: per layer, the packed weights, scales and biases of
    # the routed pairs' gate and up matrices.
    from benchmarks.decode_roofline import SHAPES, layer_bytes, layer_inputs

    wq, s, b, _ = layer_inputs("qwen3", 2)
    assert wq.nbytes + s.nbytes + b.nbytes == 2 * layer_bytes(*SHAPES["qwen3"])
    assert layer_bytes(*SHAPES["mixtral"]) == 2 * 2 * 14336 * (4096 // 2 + 4 * 4096 // 64)


def test_decode_roofline_wants_cuda():
    import mlx.core as mx

    if mx.cuda.is_available():
        pytest.skip("MLX sees CUDA here: decode_roofline would run its benchmark")
    done = subprocess.run([sys.executable, "-m", "benchmarks.decode_roofline"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "run it on a CUDA GPU" in done.stderr


def test_ab_rounds_alternate_which_tree_goes_first_and_give_this_trees_speed_ratio():
    # prefill_ab's and decode_ab's comparison: the median and range of other / this per round.
    from benchmarks.prefill_ab import alternating_rounds

    order, seconds = [], {"this": iter([1.0, 2.0, 4.0]), "other": iter([2.0, 2.0, 2.0])}

    def timed(name):
        order.append(name)
        return next(seconds[name])

    times, ratio = alternating_rounds({"this": "this", "other": "other"}, 3, timed)
    assert order == ["this", "other", "other", "this", "this", "other"]
    assert times == {"this": [1.0, 2.0, 4.0], "other": [2.0, 2.0, 2.0]}
    assert ratio == ["1.000", "0.500-2.000"]


def test_gpu_timeline_sums_each_kernels_device_time_per_layer():
    from benchmarks.gpu_timeline import kernel_events, kernel_table, summary

    trace = {"traceEvents": [
        {"cat": "cpu_op", "name": "aten::zeros", "ts": 0, "dur": 50},
        *({"cat": "kernel", "name": "gate_up", "ts": 100 + 40 * i, "dur": 12} for i in range(4)),
        *({"cat": "kernel", "name": "down", "ts": 120 + 40 * i, "dur": 8} for i in range(4)),
    ]}
    kernels = kernel_events(trace)
    assert [k["ts"] for k in kernels] == sorted(k["ts"] for k in kernels) and len(kernels) == 8
    # two reps of two layers: each kernel once a layer
    assert kernel_table(kernels, 4) == [("gate_up", 1.0, 12.0), ("down", 1.0, 8.0)]
    phases = [(40e-6, 50e-6), (44e-6, 60e-6)]  # (build, evaluation) seconds a rep
    row, lines = summary("a layer", phases, kernels, 2, 2, nbytes=20e6)
    # per layer: build 21 µs, evaluation 27.5 µs, 2 kernels, 20 µs on the device (none overlapping),
    # 20 MB / 20 µs = 1000 GB/s
    assert row == ["a layer", "21.0", "27.5", "2.0", "20.0", "20.0", "0.73", "1000"], row
    assert lines[0].startswith("  a layer: 1.0 x 12.00 µs  gate_up")


def test_gpu_timeline_counts_overlapping_kernels_once_in_the_busy_time():
    from benchmarks.gpu_timeline import busy_time

    events = [{"ts": 0, "dur": 10}, {"ts": 5, "dur": 10}, {"ts": 6, "dur": 2}, {"ts": 30, "dur": 5}]
    assert busy_time(events) == 20.0  # [0, 15) and [30, 35)
    assert busy_time([]) == 0.0


def test_gpu_timeline_times_this_packages_kernels_apart_from_mlxs():
    from benchmarks.gpu_timeline import own_kernel_time

    events = [{"name": "mlx::core::cu::custom_kernel_mlx_moe_fix_moe_prefill_grouped_smem1", "ts": 0, "dur": 10},
              {"name": "void mlx::core::cu::binary_vs<mlx::core::cu::Add>", "ts": 10, "dur": 4},
              {"name": "mlx::core::cu::custom_kernel_mlx_moe_fix_moe_prefill_route_smem0", "ts": 12, "dur": 3},
              {"name": "mlx::core::cu::custom_kernel_other_package", "ts": 20, "dur": 7}]
    assert own_kernel_time(events) == 13
    assert own_kernel_time(events[1:2]) == 0


def test_gpu_timeline_says_it_needs_a_cuda_gpu():
    import mlx.core as mx

    if mx.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the benchmark runs instead of refusing")
    from benchmarks import gpu_timeline

    with pytest.raises(SystemExit, match="CUDA GPU"):
        gpu_timeline.main(["--parts", "blocks"])


def test_decode_ab_routed_layers_count_each_layers_distinct_routed_experts(monkeypatch):
    import mlx.core as mx
    import numpy as np

    from benchmarks import decode_ab
    from mlx_moe_fix import kernels

    monkeypatch.setitem(decode_ab.SHAPES, "tiny", (128, 64, 8, 2))
    monkeypatch.setitem(decode_ab.ROUTINGS, "tiny", ("softmax_topk", True))
    built, logits, routing, per_layer_bytes = decode_ab.routed_layers("tiny", 3, kernels)
    assert len(built) == len(logits) == 3 and all(lg.shape == (1, 8) for lg in logits)
    assert routing == kernels.Routing("softmax_topk", 2, True)
    expected = []
    for layer, lg in zip(built, logits):
        per_expert = sum(layer[p].weight.nbytes + layer[p].scales.nbytes + layer[p].biases.nbytes
                         for p in ("gate_proj", "up_proj", "down_proj")) // 8
        chosen = np.argsort(-np.array(lg.astype(mx.float32))[0])[:2]  # distinct: the top 2 of 8
        expected.append(per_expert * len(set(chosen.tolist())))
    assert per_layer_bytes == sum(expected) / 3


def test_prefill_ncu_stall_tables_share_each_kernels_samples_by_opcode():
    from benchmarks.prefill_ncu import kernel_label, opcode, stalls

    name = ("mlx::core::cu::custom_kernel_mlx_moe_fix_moe_prefill_grouped_wgmma_smem81920_lb256x2_bdf5f14151ae_"
            "bfloat16_t_bfloat16_t_float_4_64_64_t_t_t_0_f_f(const __nv_bfloat16 *, const int *)")
    columns = '"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb","stall_mio","stall_mio (Not Issued)"\n'

    def kernel(kernel_name, rows):
        return f'"Kernel Name","{kernel_name}",\n' + columns + "".join(
            f'"0x{i:x}","{source}","{long_sb + mio}","{long_sb}","{mio}","0"\n' for i, (source, long_sb, mio) in enumerate(rows))

    text = kernel(name, [("      LDS R1, [R2]", 0, 30), ("@!PT  LDS RZ, [RZ]", 0, 10), ("FENCE.VIEW.ASYNC.S", 50, 0),
                         ("HGMMA.64x64x16.F32.BF16 R24, R96, gdesc[UR24], R24", 10, 0)])
    text += kernel("custom_kernel_mlx_moe_fix_moe_prefill_grouped_smem39936_lb128x3_108b121e0a17_bfloat16_t_4(int)",
                   [("HMMA.16816.F32.BF16 R1, R2, R4, R1", 3, 1)])
    (label, total, opcodes, instructions, split), (other, other_total, *_) = stalls(text, top=2)
    assert split == [("no loop", "100.0")]
    assert label == "grouped_wgmma_lb256x2 bdf5 bfloat16_t_bfloat16_t_float_4_64_64_t_t_t_0_f_f" and total == 100
    assert other == "grouped_lb128x3 108b bfloat16_t_4" and other_total == 4
    # the predicated LDS counts with the other LDS; the table keeps the top 2 opcodes
    assert opcodes == [("FENCE", "50.0", "long_sb 50.0"), ("LDS", "40.0", "mio 40.0")]
    assert instructions[0] == ("FENCE.VIEW.ASYNC.S", "50.00", "long_sb 50.0") and len(instructions) == 2
    assert opcode("@P3   BRA 0x7fd08f7be660") == "BRA" and opcode("") == "?"
    assert kernel_label("custom_kernel_other(int)") == "custom_kernel_other"


def test_prefill_ncu_sector_tables_give_each_instructions_sectors_per_warp_request(capsys):
    from benchmarks.prefill_ncu import print_sectors, sectors

    columns = ('"Address","Source","Instructions Executed","L1 Tag Requests Global","L1 Wavefronts Shared",'
               '"L1 Wavefronts Shared Ideal","L2 Theoretical Sectors Global","L2 Theoretical Sectors Global Ideal"\n')
    rows = [("LDGSTS.E.BYPASS.128 desc[UR8][R6.64], [R73]", "202,880", "811,520", "2,130,240", "811,520", "4,869,120", "3,246,080"),
            ("LDG.E.U16 R121, desc[UR8][R10.64]", "243,456", "486,912", "", "", "1,460,736", "486,912"),
            ("HMMA.16816.F32.BF16 R1, R2, R4, R1", "1,000", "", "", "", "", "")]
    text = ('"Kernel Name","custom_kernel_mlx_moe_fix_moe_prefill_grouped_smem39936_lb128x3_d8c4ec234e5e_bfloat16_t_4(int)",\n'
            + columns + "".join(f'"0x{i:x}",' + ",".join(f'"{v}"' for v in row) + "\n" for i, row in enumerate(rows)))
    [(label, total, ideal, table)] = sectors(text, top=1)
    assert label == "grouped_lb128x3 d8c4 bfloat16_t_4"
    assert (total, ideal) == (4869120 + 1460736, 3246080 + 486912)  # the HMMA asks for none
    # per warp request: 24 sectors where the bytes fill 16, 4 tags, 10.5 shared wavefronts where 4 would do
    assert table == [("LDGSTS.E.BYPASS.128 desc[UR8][R6.64], [R73]", "202880", "24.0", "16.0", "4.0", "10.5", "4.0", "76.9")]
    assert [row[2:4] for row in sectors(text)[0][3]] == [("24.0", "16.0"), ("6.0", "2.0")]
    print_sectors(sectors(text))
    assert "grouped_lb128x3 d8c4 bfloat16_t_4: 6.33 M sectors asked of L2 (0.203 GB), 3.73 M ideal" in capsys.readouterr().out


def test_prefill_ncu_splits_a_kernels_samples_around_its_main_loop():
    from benchmarks.prefill_ncu import branch_target, regions

    def row(address, source, samples):
        return {"Address": f"0x{address:x}", "Source": source, "Warp Stall Sampling (All Samples)": str(samples)}

    rows = [row(0x100, "LDG.E R1, [R2]", 5),            # prologue
            row(0x110, "LDS R3, [R4]", 2),              # inner loop 0x110-0x120 (few samples)
            row(0x120, "@P1 BRA 0x110", 1),
            row(0x130, "HMMA.16816.F32.BF16 R8, R4, R6, R8", 60),  # main loop 0x130-0x150
            row(0x140, "BAR.SYNC.DEFER_BLOCKING 0x0", 20),
            row(0x150, "@P0 BRA 0x130", 2),
            row(0x160, "@!P2 BRA 0x180", 3),            # a forward branch: no loop
            row(0x170, "STG.E.128 [R2], R8", 7)]
    assert branch_target("@P0 BRA 0x130") == 0x130 and branch_target("BAR.SYNC 0x0") is None
    assert regions(rows) == [("before the main loop", 8), ("main loop", 82), ("after it", 10)]
    assert regions(rows[:2]) == [("no loop", 7)]


def test_prefill_ncu_refuses_to_run_without_cuda_and_names_unknown_parts():
    import mlx.core as mx

    done = subprocess.run([sys.executable, "-m", "benchmarks.prefill_ncu", "--parts", "gate_up,up"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "unknown parts ['up']" in done.stderr
    if not mx.cuda.is_available():
        done = subprocess.run([sys.executable, "-m", "benchmarks.prefill_ncu"], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and "run it on a CUDA GPU" in done.stderr


def test_build_decode_pair_builds_the_same_weights_whatever_the_random_state():
    """Processes' outputs are compared (docs/experiments/kernel_cache_probe.py): each builds the same model."""
    import argparse

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from benchmarks import models

    args = argparse.Namespace(model="qwen3_moe", deepseek_layers=2, prompt=4, smoke=True)
    weights = []
    for seed in (1, 2):
        mx.random.seed(seed)
        _, built, prompt = models.build_decode_pair(args)
        weights.append(dict(tree_flatten(built[False].parameters())))
    assert weights[0].keys() == weights[1].keys()
    for name, value in weights[0].items():
        assert mx.array_equal(value, weights[1][name]).item(), name


def test_balanced_routing_gives_every_expert_the_same_pairs_and_each_token_distinct_experts():
    # prefill_ab --routing balanced: the padding's share of a prefill GEMM's time is read against
    # random routing, so no expert's run may end in a partial tile where tokens x top-k / experts
    # is a multiple of the tile.
    import mlx.core as mx
    import numpy as np

    from benchmarks.kernels import balanced_routing
    from benchmarks.prefill_ab import ROUTINGS

    indices = np.array(balanced_routing(2048, 128, 8))
    assert indices.shape == (2048, 8) and ROUTINGS["balanced"] is balanced_routing
    assert np.bincount(indices.ravel(), minlength=128).tolist() == [128] * 128
    assert all(len(set(row)) == 8 for row in indices.tolist())
    assert balanced_routing(3, 4, 4).dtype == mx.uint32
    with pytest.raises(ValueError, match="would repeat"):
        balanced_routing(4, 2, 3)



def test_in_sequence_makes_each_launch_follow_the_previous_ones_output():
    import mlx.core as mx

    from benchmarks.timing import after, in_sequence, repeated

    x = mx.arange(4, dtype=mx.float32)
    seen = []

    def launch(dependency):
        seen.append(dependency)
        return mx.sin(after(x, dependency))

    def graph(out) -> str:
        dot = io.StringIO()
        mx.export_to_dot(dot, out)
        return dot.getvalue()

    outputs = in_sequence(launch, 3)()
    assert seen[0] is None and seen[1] is outputs[0] and seen[2] is outputs[1]
    # the last launch's graph holds all three launches; side by side, each holds its own
    assert graph(outputs[-1]).count('label ="Sin"') == 3
    assert graph(repeated(lambda: launch(None), 3)()[-1]).count('label ="Sin"') == 1
    # through an op that writes a new buffer (MLX's CUDA graph orders kernels by the buffers they
    # read and write), not mx.depends, which shares the buffer and orders only the host's work
    assert "Depends" not in graph(outputs[-1])
    # the dependency orders the graph without changing the values, whatever it holds
    assert all(mx.array_equal(out, mx.sin(x)).item() for out in outputs)
    for held in (mx.array([float("nan"), 1.0]), mx.array([float("-inf")]), mx.array([7], mx.uint32)):
        assert mx.array_equal(after(x, held), x).item()


def test_prefill_ab_layer_routes_after_the_previous_launch():
    # prefill_ab --in-sequence: a model's router reads the layer's input, so the layer's routing
    # (its route launch) must wait for the previous launch as its rows do, not run ahead of it
    from types import SimpleNamespace

    import mlx.core as mx

    from benchmarks.prefill_ab import part_calls

    taken = []
    prefill = SimpleNamespace(
        tile_height=lambda pairs, experts: 16,
        route_kernel=lambda flat, experts, tile: (mx.zeros((16,), mx.int32), mx.zeros((1,), mx.int32), 1),
        gemm_kernel=lambda experts, stage, tile: None, gemm_rows=lambda rows, first: rows,
        grouped=lambda rows, *unused: rows,
        moe_prefill_kernel=lambda x, indices, experts, weights: taken.append((x, indices)) or x)
    x, indices = mx.ones((4, 8)), mx.zeros((4, 2), mx.uint32)
    layer = part_calls(prefill, SimpleNamespace(num_experts=4), x, indices, None)["layer"][0]

    def reaches_multiply(a) -> bool:
        dot = io.StringIO()
        mx.export_to_dot(dot, a)
        return 'label ="Multiply"' in dot.getvalue()

    layer(mx.ones((4, 8)) * 3)
    assert all(reaches_multiply(a) for a in taken[-1])
    layer()
    assert not any(reaches_multiply(a) for a in taken[-1])
