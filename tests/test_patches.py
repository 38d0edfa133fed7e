"""Patch lifecycle: replaced, idempotent, reverted exactly, deferred, disabled, falls through.

Every test here runs on the CPU, also on a GPU machine (its checks are of the references, exact);
the CUDA paths' own tests are in tests/parity."""

import importlib
import subprocess
import sys
import textwrap

import mlx.core as mx
import mlx.nn as nn
import pytest
import mlx_moe_fix
from mlx_moe_fix.kernels.moe_routed_decode import fused_router_unavailable_reason
from mlx_moe_fix.patches import TARGETS
from mlx_moe_fix.patches.methods import wrapper_of
from tests.subprocess_env import repo_env

pytestmark = pytest.mark.usefixtures("cpu_device")


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter, on the CPU as the tests here are."""
    environment = repo_env(**env)
    code = "import mlx.core\nmlx.core.set_default_device(mlx.core.cpu)\n" + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=300)


def imported_classes():
    return {t.name: (getattr(importlib.import_module(t.module), t.cls), t) for t in TARGETS}


def test_apply_replaces_and_revert_restores_the_same_objects():
    classes = imported_classes()
    originals = {name: cls.__dict__[t.method] for name, (cls, t) in classes.items()}
    mlx_moe_fix.apply()
    for name, (cls, t) in classes.items():
        method = cls.__dict__[t.method]
        assert wrapper_of(method) is t.wrapper and method.__wrapped__ is originals[name], name
    mlx_moe_fix.revert()
    for name, (cls, t) in classes.items():
        assert cls.__dict__[t.method] is originals[name], name


def test_apply_is_idempotent():
    classes = imported_classes()
    originals = {name: cls.__dict__[t.method] for name, (cls, t) in classes.items()}
    mlx_moe_fix.apply()
    first = {name: cls.__dict__[t.method] for name, (cls, t) in classes.items()}
    mlx_moe_fix.apply()
    mlx_moe_fix.apply(prefill=False)
    for name, (cls, t) in classes.items():
        assert cls.__dict__[t.method] is first[name], name
    assert mlx_moe_fix.status()["phases"] == {"prefill": False, "decode": True}
    mlx_moe_fix.revert()
    for name, (cls, t) in classes.items():
        assert cls.__dict__[t.method] is originals[name], name


def test_patched_context_restores_the_previous_state():
    from mlx_lm.models.switch_layers import SwitchGLU

    original = SwitchGLU.__dict__["__call__"]
    with mlx_moe_fix.patched():
        assert SwitchGLU.__dict__["__call__"] is not original
    assert SwitchGLU.__dict__["__call__"] is original
    mlx_moe_fix.apply()
    with mlx_moe_fix.patched(decode=False):
        assert mlx_moe_fix.status()["phases"]["decode"] is False
    assert mlx_moe_fix.status()["applied"] and mlx_moe_fix.status()["phases"]["decode"] is True


def test_the_package_version_is_the_one_pyproject_installs():
    import re
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE).group(1) == mlx_moe_fix.__version__


def test_status_reports_every_target_with_a_reason():
    imported_classes()
    mlx_moe_fix.apply()
    status = mlx_moe_fix.status()
    states = {t["target"]: t["state"] for t in status["targets"]}
    assert states["mlx_lm.models.switch_layers.SwitchGLU.__call__"] == "patched"
    assert states["mlx_vlm.models.inkling.language.InklingSparseMoE.__call__"] == "patched"
    assert all(t["reason"] for t in status["targets"])
    assert status["backend"] in ("cpu", "cuda", "metal")
    assert status["versions"]["mlx"] == mx.__version__
    assert status["versions"]["mlx-moe-fix"] == mlx_moe_fix.__version__ is not None
    gemm = status["prefill_gemm"]
    assert gemm["reason"] and (gemm["gemm"] is None) == (status["ops"]["moe_prefill"]["path"] != "kernel")
    inside = status["routed_decode_router_inside"]
    runs_here = status["ops"]["moe_routed_decode"]["path"] == "kernel" and mx.cuda.is_available()
    assert inside["reason"] and inside["on"] == (runs_here and fused_router_unavailable_reason() is None)
    mlx_moe_fix.revert()
    assert {t["state"] for t in mlx_moe_fix.status()["targets"]} == {"not applied"}


def test_deferred_import_is_patched_and_apply_does_not_import_mlx_vlm():
    result = run_python(
        """
        import sys, mlx_moe_fix
        from mlx_moe_fix.patches.methods import wrapper_of
        mlx_moe_fix.apply()
        assert not any(m.startswith("mlx_vlm") for m in sys.modules), "apply() imported mlx_vlm"
        states = {t["target"]: t["state"] for t in mlx_moe_fix.status()["targets"]}
        assert states["mlx_vlm.models.switch_layers.SwitchGLU.__call__"] == "deferred", states
        from mlx_vlm.models.switch_layers import SwitchGLU
        assert wrapper_of(SwitchGLU.__dict__["__call__"]) is not None
        print("ok")
        """
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def test_revert_makes_deferred_hooks_inert():
    result = run_python(
        """
        import mlx_moe_fix
        from mlx_moe_fix.patches.methods import wrapper_of
        mlx_moe_fix.apply()
        mlx_moe_fix.revert()
        from mlx_vlm.models.switch_layers import SwitchGLU
        assert wrapper_of(SwitchGLU.__dict__["__call__"]) is None
        assert all(t["state"] == "not applied" for t in mlx_moe_fix.status()["targets"])
        print("ok")
        """
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def test_disable_env_makes_apply_a_no_op():
    result = run_python(
        """
        import mlx_moe_fix
        from mlx_moe_fix.patches.methods import wrapper_of
        from mlx_lm.models.switch_layers import SwitchGLU
        mlx_moe_fix.apply()
        assert wrapper_of(SwitchGLU.__dict__["__call__"]) is None
        status = mlx_moe_fix.status()
        assert status["disabled_by_env"] and not status["applied"]
        print("ok")
        """,
        MLX_MOE_FIX_DISABLE="1",
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def test_apply_leaves_upstreams_code_where_no_kernel_is_on():
    # the suite runs with MLX_MOE_FIX_REFERENCES=1 (conftest); here the default
    result = run_python(
        """
        import os
        import mlx_moe_fix
        from mlx_moe_fix.patches.methods import wrapper_of
        from mlx_lm.models.switch_layers import SwitchGLU
        original = SwitchGLU.__dict__["__call__"]
        mlx_moe_fix.apply()
        assert SwitchGLU.__dict__["__call__"] is original
        status = mlx_moe_fix.status()
        assert not status["applied"] and "CPU" in status["why_not_applied"], status["why_not_applied"]
        assert "MLX_MOE_FIX_REFERENCES=1" in status["why_not_applied"]
        states = {t["state"] for t in status["targets"] if "not installed" not in t["reason"]}
        reasons = {t["reason"] for t in status["targets"] if "not installed" not in t["reason"]}
        assert states == {"not applied"} and reasons == {status["why_not_applied"]}, (states, reasons)
        import mlx.core as mx
        import mlx.nn as nn
        layer = SwitchGLU(64, 64, 4)
        nn.quantize(layer, group_size=64, bits=4)
        with mlx_moe_fix.patched(references=True):
            assert wrapper_of(SwitchGLU.__dict__["__call__"]) is not None
            assert mlx_moe_fix.status()["why_not_applied"] is None
            # the switch holds for the block: its calls take the references, not upstream's code
            mx.eval(layer(mx.ones((1, 1, 64)), mx.array([[[0, 2]]])))
            paths = {(r.layer, r.path) for r in mlx_moe_fix.path_counts()}
            assert paths == {("SwitchGLU", "reference")}, paths
        assert SwitchGLU.__dict__["__call__"] is original and os.environ["MLX_MOE_FIX_REFERENCES"] == ""
        with mlx_moe_fix.patched():
            assert SwitchGLU.__dict__["__call__"] is original
        mlx_moe_fix.revert()
        assert mlx_moe_fix.status()["why_not_applied"] is None
        os.environ["MLX_MOE_FIX_REFERENCES"] = "1"
        mlx_moe_fix.apply()
        assert wrapper_of(SwitchGLU.__dict__["__call__"]) is not None and mlx_moe_fix.status()["applied"]
        print("ok")
        """,
        MLX_MOE_FIX_REFERENCES="",
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def test_no_kernel_reason_by_backend(monkeypatch, switch):
    from mlx_moe_fix import patches

    switch("MLX_MOE_FIX_REFERENCES", "0")
    for backend, expected in (("cuda", None), ("metal", "MLX_MOE_FIX_METAL_DECODE=1"), ("cpu", "CPU")):
        monkeypatch.setattr(patches, "current_backend", lambda: backend)
        reason = patches.no_kernel_reason()
        assert reason is None if expected is None else expected in reason, (backend, reason)
    monkeypatch.setattr(patches, "current_backend", lambda: "metal")
    switch("MLX_MOE_FIX_METAL_DECODE", "1")
    assert patches.no_kernel_reason() is None
    switch("MLX_MOE_FIX_METAL_DECODE", "0")
    switch("MLX_MOE_FIX_REFERENCES", "1")
    assert patches.no_kernel_reason() is None


def test_trace_env_logs_each_path_once_per_shape_class():
    result = run_python(
        """
        import mlx.core as mx, mlx.nn as nn, mlx_moe_fix
        from mlx_lm.models.switch_layers import SwitchGLU
        layer = SwitchGLU(64, 64, 4); nn.quantize(layer, group_size=64, bits=4)
        mlx_moe_fix.apply()
        for _ in range(3):
            mx.eval(layer(mx.random.normal((1, 1, 64)), mx.array([[[0, 2]]], dtype=mx.uint32)))
        mx.eval(layer(mx.random.normal((1, 40, 64)), mx.zeros((1, 40, 2), dtype=mx.uint32)))
        """,
        MLX_MOE_FIX_TRACE="1",
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("[mlx-moe-fix]")]
    assert len(lines) == 2, result.stderr
    assert "SwitchGLU decode" in lines[0] and "-> reference" in lines[0]
    assert "SwitchGLU prefill" in lines[1]


class ReluGLU(nn.Module):
    """An activation the ops do not know."""

    def __call__(self, x, gate):
        return nn.relu(gate) * x


def relu_glu(x, gate):
    """The same as a function."""
    return nn.relu(gate) * x


def minimax_swiglu(beta):
    """mlx-vlm's MiniMax-M3-VL activation: gpt-oss's SwiGLU at beta 1, else one the ops do not know."""
    from mlx_vlm.models.minimax_m3_vl.language import MiniMaxSwiGLUOAI

    return MiniMaxSwiGLUOAI(beta=beta)


def quantized_glu(mode="affine", bits=4, activation=None):
    from mlx_lm.models.switch_layers import SwitchGLU

    layer = SwitchGLU(64, 64, 4) if activation is None else SwitchGLU(64, 64, 4, activation=activation)
    nn.quantize(layer, group_size=32, bits=bits, mode=mode)
    return layer


def assert_patched_output_is_stock(layer):
    x = mx.random.normal((1, 3, 64))
    indices = mx.array([[[0, 1], [2, 3], [1, 2]]], dtype=mx.uint32)
    expected = layer(x, indices)
    with mlx_moe_fix.patched():
        out = layer(x, indices)
    assert mx.array_equal(out, expected).item()


@pytest.mark.parametrize(
    "make_layer, reason_part",
    [
        (lambda: quantized_glu(mode="mxfp8", bits=8), "mxfp8"),
        (lambda: quantized_glu(bits=3), "3-bit"),
        (lambda: quantized_glu(activation=ReluGLU()), "activation ReluGLU is not recognised"),
        (lambda: quantized_glu(activation=mx.compile(relu_glu)), "activation relu_glu is not recognised"),
        (lambda: quantized_glu(activation=minimax_swiglu(beta=0.5)), "activation MiniMaxSwiGLUOAI is not recognised"),
    ],
    ids=["mxfp8", "3-bit", "unknown-activation", "unknown-compiled-function", "minimax-beta-not-1"],
)
def test_unsupported_layers_fall_through_to_stock_and_say_why(make_layer, reason_part):
    assert_patched_output_is_stock(make_layer())
    stock = [r for r in mlx_moe_fix.path_counts() if r.layer == "SwitchGLU" and r.path == "stock"]
    assert stock and reason_part in stock[0].reason, mlx_moe_fix.path_counts()


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_a_layer_quantized_with_mlx_defaults_takes_the_ops(mode):
    # nn.quantize without a group size or bits leaves them None on mlx-lm's QuantizedSwitchLinear
    # (MLX's matmuls then take the mode's defaults): the description must resolve them alike.
    from mlx_lm.models.switch_layers import SwitchGLU

    layer = SwitchGLU(64, 64, 4)
    nn.quantize(layer, mode=mode)
    assert (layer.up_proj.group_size, layer.up_proj.bits) == (None, None)
    assert_patched_output_is_stock(layer)
    records = mlx_moe_fix.path_counts()
    assert [(r.layer, r.path) for r in records] == [("SwitchGLU", "reference")], records


@pytest.mark.parametrize("make_activation", [lambda: None, lambda: minimax_swiglu(beta=1.0)], ids=["swiglu", "minimax-beta-1"])
def test_supported_layer_takes_the_ops_not_stock(make_activation):
    assert_patched_output_is_stock(quantized_glu(activation=make_activation()))
    records = mlx_moe_fix.path_counts()
    assert [(r.layer, r.phase, r.path) for r in records] == [("SwitchGLU", "decode", "reference")]


def test_decode_disabled_leaves_decode_on_stock():
    layer = quantized_glu()
    with mlx_moe_fix.patched(decode=False):
        layer(mx.random.normal((1, 1, 64)), mx.array([[[0, 1]]], dtype=mx.uint32))
    records = mlx_moe_fix.path_counts()
    assert {r.layer for r in records} == {"SwitchGLU", "QuantizedSwitchLinear"}
    assert all(r.path == "stock" and "decode disabled" in r.reason for r in records), records


def test_described_layer_is_redescribed_when_its_weights_change():
    from mlx_moe_fix.patches.switch_layers import GLU_PROJECTIONS, describe

    layer = quantized_glu()
    first, _ = describe(layer, GLU_PROJECTIONS)
    assert describe(layer, GLU_PROJECTIONS)[0] is first
    layer.set_dtype(mx.float16)  # new scales arrays
    second, _ = describe(layer, GLU_PROJECTIONS)
    assert second is not first and second.projections[0].scales.dtype == mx.float16


@pytest.mark.parametrize("part", ["biases", "bias"])
def test_a_patched_layer_follows_a_replaced_quantization_bias_or_additive_bias(part):
    # describe() keeps a layer's description while its arrays are the same objects: an array
    # replaced alone, a projection's quantization biases or its additive bias, must reach the ops.
    from mlx_lm.models.switch_layers import SwitchGLU

    layer = SwitchGLU(64, 64, 4, bias=True)
    nn.quantize(layer, group_size=32, bits=4)
    x = mx.random.normal((1, 3, 64))
    indices = mx.array([[[0, 1], [2, 3], [1, 2]]], dtype=mx.uint32)
    with mlx_moe_fix.patched():
        before = layer(x, indices)
        layer.down_proj[part] = layer.down_proj[part] + 1.0
        out = layer(x, indices)
    expected = layer(x, indices)
    assert not mx.array_equal(expected, before).item()
    assert mx.array_equal(out, expected).item()


def test_a_patched_expert_projection_follows_its_replaced_arrays_and_says_why_it_falls_through():
    # the projection's description is kept while its arrays are the same objects (describe_linear)
    for layer, path in ((quantized_glu(), "reference"), (quantized_glu(mode="mxfp8", bits=8), "stock")):
        projection = layer.up_proj
        x = mx.random.normal((3, 1, 1, 64))
        indices = mx.array([[0, 1], [2, 3], [1, 2]], dtype=mx.uint32)
        mlx_moe_fix.reset_path_counts()
        with mlx_moe_fix.patched():
            before = projection(x, indices)
            projection["scales"] = projection["scales"] * 2
            out = projection(x, indices)
        expected = projection(x, indices)
        assert not mx.array_equal(expected, before).item()
        assert mx.array_equal(out, expected).item()
        records = mlx_moe_fix.path_counts()
        assert {(r.layer, r.path) for r in records} == {("QuantizedSwitchLinear", path)}, records
        assert path == "reference" or all("mxfp8" in r.reason for r in records), records


def test_quantized_switch_linear_called_positionally():
    """sorted_indices given positionally, as a caller may: same output as stock."""
    layer = quantized_glu()
    x = mx.random.normal((6, 1, 64))
    indices = mx.array([0, 0, 1, 2, 3, 3], dtype=mx.uint32)
    expected = layer.up_proj(x, indices, True)
    with mlx_moe_fix.patched():
        out = layer.up_proj(x, indices, True)
    assert mx.array_equal(out, expected).item()
    assert {r.layer for r in mlx_moe_fix.path_counts()} == {"QuantizedSwitchLinear"}


@pytest.mark.parametrize("family", [[], ["--family", "gemma4_text"]], ids=["default", "breadth-family"])
def test_demo_command_reports_parity(family):
    result = run_demo(*family)
    assert result.returncode == 0, result.stderr
    same_tokens, paths = patched_row(result.stdout)
    assert same_tokens == "yes" and "reference" in paths
    assert "apply() alone patches nothing here" in result.stderr


def run_demo(*args: str, prompt_tokens: int = 64):
    # as a user runs it: MLX_MOE_FIX_REFERENCES unset, so on the CPU the demo itself asks for the
    # references (apply() alone would patch nothing there) and says so
    return subprocess.run(
        [sys.executable, "-m", "mlx_moe_fix", "demo", *args, "--prompt-tokens", str(prompt_tokens), "--new-tokens", "8",
         "--repeats", "1", "--cpu"],
        capture_output=True, text=True, env=repo_env(MLX_MOE_FIX_REFERENCES=""), timeout=300,
    )


def patched_row(table: str) -> tuple:
    """(same greedy tokens, paths taken) of the demo table's patched row."""
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()]
    row = next(row for row in rows if row[0] == "patched")
    return row[3], row[4]


def test_env_switches_are_read_at_apply(monkeypatch):
    """The switches are read once per apply(), not per call (os.environ costs ~0.7 us a read)."""
    from mlx_moe_fix.env import flag

    monkeypatch.delenv("MLX_MOE_FIX_TRACE", raising=False)
    mlx_moe_fix.apply()
    assert not flag("MLX_MOE_FIX_TRACE")
    monkeypatch.setenv("MLX_MOE_FIX_TRACE", "1")
    assert not flag("MLX_MOE_FIX_TRACE")
    mlx_moe_fix.apply()
    assert flag("MLX_MOE_FIX_TRACE")
    monkeypatch.setenv("MLX_MOE_FIX_TRACE", "0")
    mlx_moe_fix.apply()
    assert not flag("MLX_MOE_FIX_TRACE")


def test_the_kernel_switches_are_on_unless_set_to_0(monkeypatch):
    from mlx_moe_fix.env import flag, refresh

    names = ("MLX_MOE_FIX_CUDA_PREFILL", "MLX_MOE_FIX_CUDA_DECODE", "MLX_MOE_FIX_CUDA_ROUTER",
             "MLX_MOE_FIX_CUDA_ROUTED_DECODE", "MLX_MOE_FIX_COMPILED_DECODE")
    for value, on in ((None, True), ("", True), ("0", False), ("1", True)):
        for name in names:
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        refresh()
        assert [flag(name) for name in names] == [on] * len(names), value
    monkeypatch.undo()
    refresh()


def test_plan_sends_batched_decode_with_many_pairs_per_expert_to_the_grouped_kernel(monkeypatch):
    import mlx_moe_fix.kernels as kernels
    from mlx_moe_fix.kernels.backend import Implementation
    from tests.parity.cases import make_case

    grouped_kernel = Implementation(lambda *a: None, "kernel", "CUDA moe_prefill kernel")
    monkeypatch.setattr(kernels, "moe_prefill_implementation", lambda experts, dtype: grouped_kernel)
    for tokens, phase, function in ((3, "decode", None), (4, "decode", grouped_kernel.function),
                                    (8, "decode", grouped_kernel.function), (40, "prefill", grouped_kernel.function)):
        # 4 experts, top-2: from 8 pairs (2 per expert) on, decode calls take the grouped kernel.
        case = make_case(mx.bfloat16, (4, 64), True, "swiglu", 0.25, False, 64, 64, 4, 2, 1, tokens)
        chosen = kernels.plan(case.x, case.indices, case.experts)
        assert chosen.phase == phase, tokens
        if function is None:
            assert chosen.function is not grouped_kernel.function and chosen.path == "reference"
        else:
            assert chosen.function is grouped_kernel.function and chosen.path == "kernel", tokens


def test_a_call_no_kernel_takes_runs_upstreams_code_unless_the_references_are_asked_for(monkeypatch):
    import mlx_moe_fix.kernels as kernels
    from mlx_moe_fix import env
    from mlx_moe_fix.kernels.backend import Implementation
    from tests.parity.cases import make_case

    no_kernel = Implementation(lambda *a: None, "reference", "no kernel for these experts")
    monkeypatch.setattr(kernels, "moe_prefill_implementation", lambda experts, dtype: no_kernel)
    monkeypatch.setattr(kernels, "moe_decode_implementation", lambda experts, dtype: no_kernel)
    for tokens, phase in ((1, "decode"), (40, "prefill")):
        case = make_case(mx.bfloat16, (4, 64), True, "swiglu", 0.25, False, 64, 64, 8, 2, 1, tokens)
        for references, path, function in (("0", "stock", None), ("1", "reference", no_kernel.function),
                                           ("0", "stock", None)):
            with env.switched("MLX_MOE_FIX_REFERENCES", references):
                chosen = kernels.plan(case.x, case.indices, case.experts)
            assert (chosen.phase, chosen.path, chosen.function) == (phase, path, function), (tokens, references)
            assert chosen.reason.startswith(no_kernel.reason)
            assert ("upstream's code runs" in chosen.reason) == (path == "stock")


def test_fp4_experts_take_the_cuda_kernels_against_the_activations_each_reads_them_with(monkeypatch):
    # gpt-oss and DeepSeek-V4 ship mxfp4 experts, Inkling nvfp4 ones: the grouped prefill GEMM
    # dequantises both against bf16, the decode GEMV reads both against bf16 / fp16; other calls
    # plan as upstream's code, saying why.
    import mlx_moe_fix.kernels as kernels
    from mlx_moe_fix import env
    from mlx_moe_fix.kernels import backend
    from mlx_moe_fix.kernels.moe_decode import moe_decode_kernel
    from mlx_moe_fix.kernels.moe_prefill import moe_prefill_kernel
    from tests.parity.cases import make_case

    for module in (backend, sys.modules["mlx_moe_fix.kernels.moe_decode"]):
        monkeypatch.setattr(module, "current_backend", lambda: "cuda")
    for mode, dtype, tokens, phase, kernel, reason in (
            ("mxfp4", mx.bfloat16, 1, "decode", moe_decode_kernel, None), ("mxfp4", mx.bfloat16, 40, "prefill", moe_prefill_kernel, None),
            ("mxfp4", mx.float16, 1, "decode", moe_decode_kernel, None),
            ("mxfp4", mx.float16, 40, "prefill", None, "mxfp4 experts against mlx.core.float16 activations"),
            ("mxfp4", mx.float32, 1, "decode", None, "mxfp4 experts against mlx.core.float32 activations"),
            ("nvfp4", mx.bfloat16, 40, "prefill", moe_prefill_kernel, None),
            ("nvfp4", mx.bfloat16, 1, "decode", moe_decode_kernel, None),
            ("nvfp4", mx.float16, 1, "decode", moe_decode_kernel, None),
            ("nvfp4", mx.float32, 1, "decode", None, "nvfp4 experts against mlx.core.float32 activations")):
        case = make_case(dtype, (4, 32 if mode == "mxfp4" else 16, mode), True, "swiglu_oai", 7.0, False, 64, 64, 8, 2, 1, tokens,
                         bias=True)
        with env.switched("MLX_MOE_FIX_REFERENCES", "0"):
            chosen = kernels.plan(case.x, case.indices, case.experts)
        assert (chosen.phase, chosen.path, chosen.function) == (phase, "kernel" if kernel else "stock", kernel), (mode, dtype, chosen)
        assert kernel or reason in chosen.reason, chosen


def test_routed_plan_fuses_decode_sized_calls_only(monkeypatch):
    import mlx_moe_fix.kernels as kernels
    from mlx_moe_fix.kernels import Routing, backend
    from mlx_moe_fix.kernels.moe_routed_decode import moe_routed_decode_kernel
    from tests.parity.cases import make_case

    monkeypatch.setattr(backend, "current_backend", lambda: "cuda")
    routing = Routing("topk_softmax", 2)
    for tokens, fused in ((1, True), (7, True), (8, False), (40, False)):
        # 8 experts, top-2: from 16 pairs (2 per expert) on, the grouped kernel takes the experts.
        case = make_case(mx.bfloat16, (4, 64), True, "swiglu", 0.25, False, 64, 64, 8, 2, 1, tokens)
        logits = mx.zeros((1, tokens, 8), mx.bfloat16)
        chosen = kernels.routed_plan(case.x, logits, routing, case.experts)
        assert (chosen is not None) == fused, tokens
        if fused:
            assert chosen.function is moe_routed_decode_kernel and (chosen.phase, chosen.path) == ("decode", "kernel")
    case = make_case(mx.bfloat16, (4, 64), True, "swiglu", 0.25, False, 64, 64, 8, 2, 1, 1)
    assert kernels.routed_plan(case.x, mx.zeros((1, 1, 8), mx.bfloat16), routing, case.experts, decode=False) is None
    assert kernels.routed_plan(case.x, mx.zeros((1, 1, 9), mx.bfloat16), routing, case.experts) is None
    assert kernels.routed_plan(case.x, mx.zeros((1, 1, 8), mx.float32), routing, case.experts) is None


def test_a_routed_block_takes_the_fused_op_only_through_the_patched_experts_call(monkeypatch):
    """The block counts the fused call as its experts' call; a tool intercepting the experts
    layer (zoo.intercepting) sees the call made to it instead."""
    from mlx_moe_fix import trace, zoo
    from mlx_moe_fix.kernels import Plan, Routing
    from mlx_moe_fix.patches import switch_layers

    model = zoo.build("qwen3_moe", 4)
    block = next(m for _, m in model.named_modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock")
    x = mx.random.normal((1, 1, model.args.hidden_size))
    fused = []

    def fused_op(x, logits, routing, experts, residual, shared, correction_bias, global_scale):
        assert shared is correction_bias is global_scale is None  # qwen3_moe's block has no shared experts
        fused.append((routing, residual))
        return mx.zeros(x.shape, x.dtype)

    monkeypatch.setattr(switch_layers, "routed_plan", lambda *args, **kwargs: Plan("decode", "kernel", "fused", fused_op))
    seen = []
    residual = mx.random.normal(x.shape)
    with mlx_moe_fix.patched():
        trace.reset_path_counts()
        assert mx.array_equal(block(x), mx.zeros(x.shape)).item()
        block(x, residual)  # the decoder layer's residual (patches/decoder_layers.py) goes to the fused op
        routing = Routing("softmax_topk", block.top_k, bool(block.norm_topk_prob))
        assert fused == [(routing, None), (routing, residual)]
        assert trace.path_counts() == {trace.PathRecord("SwitchGLU", "decode", "kernel", "fused"): 2}
        with zoo.intercepting([block.switch_mlp], lambda layer, call, *args, **kwargs: seen.append(kwargs) or call(*args, **kwargs)):
            intercepted = block(x)
            intercepted_with_residual = block(x, residual)
    assert len(fused) == 2 and [set(kwargs) for kwargs in seen] == [{"weights"}] * 2
    assert not mx.array_equal(intercepted, mx.zeros(x.shape)).item()
    # the experts' call unfused: the residual added after it
    assert mx.array_equal(intercepted_with_residual, residual + intercepted).item()


def test_status_says_whether_prefill_shapes_are_compiled_and_why(monkeypatch):
    from mlx_moe_fix import env
    from mlx_moe_fix.patches import compiled

    def shapes():
        env.refresh()
        state = mlx_moe_fix.status()["compiled_prefill_shapes"]
        # the per-call check and the reported reason must agree
        assert compiled.eligible("prefill") == state["on"] == (compiled.why_not_compiled("prefill") is None)
        return state

    monkeypatch.setattr(compiled, "BACKENDS", (mlx_moe_fix.current_backend(),))
    assert shapes()["on"] is True and "more than 32 tokens" in shapes()["reason"]
    with mlx_moe_fix.patched(prefill=False):
        assert shapes() == {"on": False, "reason": "prefill disabled by apply(prefill=False)"}
        assert compiled.eligible("decode"), "the phases are switched apart"
    monkeypatch.setenv("MLX_MOE_FIX_CUDA_PREFILL", "0")
    assert "MLX_MOE_FIX_CUDA_PREFILL=0" in shapes()["reason"]
    monkeypatch.setenv("MLX_MOE_FIX_COMPILED_PREFILL", "0")
    assert shapes() == {"on": False, "reason": "switched off (MLX_MOE_FIX_COMPILED_PREFILL=0)"}
    monkeypatch.delenv("MLX_MOE_FIX_CUDA_PREFILL")
    assert not shapes()["on"]
    monkeypatch.delenv("MLX_MOE_FIX_COMPILED_PREFILL")
    assert shapes()["on"] is True


def test_status_says_whether_decode_steps_are_compiled_and_why(monkeypatch):
    from mlx_moe_fix import env
    from mlx_moe_fix.patches import compiled

    def steps():
        env.refresh()
        state = mlx_moe_fix.status()["compiled_decode_steps"]
        # the per-call check and the reported reason must agree
        assert compiled.eligible() == state["on"] == (compiled.why_not_compiled() is None)
        return state

    monkeypatch.setattr(compiled, "BACKENDS", ("nowhere",))
    assert steps() == {"on": False, "reason": f"{mlx_moe_fix.current_backend()}: only the CUDA kernels' calls are compiled"}
    monkeypatch.setattr(compiled, "BACKENDS", (mlx_moe_fix.current_backend(),))
    assert steps()["on"] is True
    with mlx_moe_fix.patched(decode=False):
        assert steps() == {"on": False, "reason": "decode disabled by apply(decode=False)"}
    monkeypatch.setenv("MLX_MOE_FIX_CUDA_DECODE", "0")
    assert "MLX_MOE_FIX_CUDA_DECODE=0" in steps()["reason"]
    monkeypatch.setenv("MLX_MOE_FIX_COMPILED_DECODE", "0")
    assert steps() == {"on": False, "reason": "switched off (MLX_MOE_FIX_COMPILED_DECODE=0)"}
    monkeypatch.delenv("MLX_MOE_FIX_COMPILED_DECODE")
    monkeypatch.setenv("MLX_MOE_FIX_CUDA_DECODE", "1")
    assert steps()["on"] is True
    with compiled.suspended():
        assert steps()["reason"] == "suspended while layer calls are intercepted (zoo.intercepting)"
    monkeypatch.undo()
    env.refresh()


def test_replayed_path_records_count_as_calls_past_the_fold_and_with_restore():
    from collections import Counter

    from mlx_moe_fix import trace

    decode = trace.PathRecord("SwitchGLU", "decode", "kernel", "fused")
    prefill = trace.PathRecord("SwitchGLU", "prefill", "kernel", "grouped")
    two_decode, one_prefill = Counter({decode: 2}), Counter({prefill: 1})
    trace.reset_path_counts()
    replays = trace._FOLD_REPLAYED_AT + 10  # folded once on the way, the rest when read
    for _ in range(replays):
        trace.replay(two_decode)
    trace.replay(one_prefill)
    before = trace.path_counts()
    assert before == {decode: 2 * replays, prefill: 1}
    trace.replay(two_decode)
    trace.restore(before)  # drops the replay not yet counted too
    assert trace.path_counts() == before
    trace.replay(one_prefill)
    trace.reset_path_counts()
    assert trace.path_counts() == {}


def first_layer_and_block(model):
    layer = model.model.layers[0] if hasattr(model, "model") else model.layers[0]
    block_name = "block_sparse_moe" if "block_sparse_moe" in layer else "mlp"
    return layer, layer[block_name]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_a_decoder_layer_hands_its_residual_to_its_moe_block_and_gives_stocks_output(cpu_device, family, monkeypatch):
    """patches/decoder_layers.py: the layer calls block(norm(h), h), whose wrapper adds h (on the
    CPU after the experts' call: kernels.add_residual); the output is upstream's bit for bit (the
    CUDA kernel's add: tests/parity/test_router.py). With the switch off, or a block that cannot
    take the residual, upstream's method runs."""
    from mlx_moe_fix import env, zoo
    from mlx_moe_fix.patches import methods, moe_blocks

    model = zoo.build(family, 4)
    layer, block = first_layer_and_block(model)
    x = mx.random.normal((1, 3, model.args.hidden_size), key=mx.random.key(0))
    mask = None if family != "gpt_oss" else "causal"
    stock = layer(x, mask)
    block_calls = []  # the arguments of each call of the block
    with mlx_moe_fix.patched():
        patched_call = type(block).__call__

        def spy(self, *args, **kwargs):
            block_calls.append(args)
            return patched_call(self, *args, **kwargs)

        setattr(spy, methods._WRAPPER, wrapper_of(patched_call))  # still the routed block's patched method
        type(block).__call__ = spy
        try:
            assert moe_blocks.takes_residual(block)
            assert mx.array_equal(layer(x, mask), stock).item()
            assert len(block_calls) == 1 and len(block_calls[0]) == 2 and block_calls[0][1].shape == x.shape
            monkeypatch.setenv("MLX_MOE_FIX_RESIDUAL_IN_BLOCK", "0")
            env.refresh()
            assert mx.array_equal(layer(x, mask), stock).item() and len(block_calls[1]) == 1
        finally:
            type(block).__call__ = patched_call
            monkeypatch.delenv("MLX_MOE_FIX_RESIDUAL_IN_BLOCK", raising=False)
            env.refresh()
        block.sharding_group = object()  # a sharded block's call is upstream's, of x alone
        assert not moe_blocks.takes_residual(block)
        del block.sharding_group
    assert not moe_blocks.takes_residual(block)  # reverted: upstream's block


def test_a_restating_patch_leaves_another_version_of_its_method_as_it_is(monkeypatch):
    """A decoder-layer wrapper restates upstream's method: where the source differs from the one
    it restates (here: a digest that matches no source), the method stays upstream's and status()
    says why."""
    import dataclasses

    from mlx_lm.models.qwen3_moe import Qwen3MoeDecoderLayer
    from mlx_moe_fix import patches
    from mlx_moe_fix.patches.targets import source_digest

    original = Qwen3MoeDecoderLayer.__dict__["__call__"]
    (target,) = [t for t in patches.TARGETS if t.cls == "Qwen3MoeDecoderLayer"]
    assert target.source_digest == source_digest(original)  # the installed mlx-lm's is the one restated
    other = dataclasses.replace(target, source_digest="0" * 16)
    monkeypatch.setattr(patches, "TARGETS", tuple(other if t is target else t for t in patches.TARGETS))
    mlx_moe_fix.apply()
    try:
        assert Qwen3MoeDecoderLayer.__dict__["__call__"] is original
        state, reason = patches.target_state(other)
        assert state == "unsupported" and "0000000000000000" in reason and target.source_digest in reason
    finally:
        mlx_moe_fix.revert()
    assert patches.target_state(other)[0] == "not applied"


def test_every_known_activation_and_shared_experts_class_exists_upstream():
    # Recognition is by exact class (or function) in upstream's modules: a rename upstream would
    # leave those layers on stock code without a word, so the installed mlx-lm / mlx-vlm must have
    # every one listed.
    import importlib

    from mlx_moe_fix.patches.activations import KNOWN_ACTIVATION_FUNCTIONS, KNOWN_ACTIVATIONS, KNOWN_SHARED_EXPERTS

    for module_name, name, _ in KNOWN_ACTIVATIONS + KNOWN_ACTIVATION_FUNCTIONS + KNOWN_SHARED_EXPERTS:
        assert hasattr(importlib.import_module(module_name), name), f"{module_name}.{name}"


def test_demo_runs_a_saved_checkpoint(tmp_path):
    from mlx_moe_fix import zoo

    zoo.save_checkpoint("mixtral", 4, tmp_path)
    weights = mx.load(str(next(tmp_path.glob("*.safetensors"))))
    assert {a.dtype for name, a in weights.items() if name.endswith((".scales", "norm.weight"))} == {mx.bfloat16}
    result = run_demo("--model", str(tmp_path), prompt_tokens=40)
    assert result.returncode == 0, result.stderr
    assert f"{tmp_path} (mlx-lm's mixtral, loaded in" in result.stderr
    assert patched_row(result.stdout) == ("yes", "SwitchGLU decode: reference; SwitchGLU prefill: reference")
    assert "upstream's code" not in result.stdout


class TanhGate(nn.Module):
    """An activation the ops do not know."""

    def __call__(self, x, gate):
        return nn.tanh(gate) * x


def test_demo_says_why_calls_stay_on_upstreams_code(capsys):
    from mlx_moe_fix import cli, zoo

    model = zoo.build("mixtral", 4)
    for _, layer in zoo.moe_layers(model):
        layer.activation = TanhGate()
    assert cli.demo(model, zoo.prompt_for("mixtral", 40), "mixtral", 8, 1) == 0
    out = capsys.readouterr().out
    assert "SwitchGLU prefill: upstream's code: activation" in out and "TanhGate" in out, out


def test_status_command_gives_the_reason_nothing_was_patched_once(monkeypatch, capsys):
    from mlx_moe_fix import cli

    why = "no kernel of ours runs here"
    status = mlx_moe_fix.status()
    status["why_not_applied"] = why
    status["targets"] = [{**t, "state": "not applied", "reason": why} for t in status["targets"]]
    status["targets"][0]["reason"] = "a reason of its own"
    monkeypatch.setattr(mlx_moe_fix, "status", lambda: status)
    assert cli.show_status(False) == 0
    out = capsys.readouterr().out
    assert out.count(why) == 1 and f"not applied: {why}" in out
    rows = [line for line in out.splitlines() if "| not applied |" in line]
    assert len(rows) == len(status["targets"]) and "a reason of its own" in rows[0]
    assert all(row.rstrip(" |").endswith("the reason above") for row in rows[1:])


def save_vlm_checkpoint(folder):
    """A small random glm4v_moe checkpoint (vision tower and MoE language model) written as
    mlx-vlm's converter writes one; mlx-lm has no glm4v_moe, so the demo loads it through mlx-vlm."""
    import dataclasses

    from mlx_vlm.models.glm4v_moe import Model, ModelConfig, TextConfig, VisionConfig
    from mlx_vlm.utils import save_config, save_weights

    from mlx_moe_fix import zoo

    text = {**zoo.BREADTH_FAMILIES["glm4v_moe_vlm"].config, "model_type": "glm4v_moe_text"}
    # widths 32: the vision tower's layers stay unquantized, as mlx-vlm's loader infers per layer
    vision = {"model_type": "glm4v_moe", "depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2,
              "patch_size": 14, "out_hidden_size": 128, "spatial_merge_size": 2, "temporal_patch_size": 2}
    config = ModelConfig(text_config=TextConfig.from_dict(text), vision_config=VisionConfig.from_dict(vision),
                         model_type="glm4v_moe")
    save_weights(folder, zoo.randomized(Model(config), 4))
    save_config({**dataclasses.asdict(config), "text_config": text, "vision_config": vision,
                 "quantization": {"group_size": zoo.GROUP_SIZE, "bits": 4}}, folder / "config.json")


def test_demo_runs_a_saved_vlm_checkpoint(tmp_path):
    save_vlm_checkpoint(tmp_path)
    result = run_demo("--model", str(tmp_path), prompt_tokens=40)
    assert result.returncode == 0, result.stderr
    assert f"{tmp_path} (mlx-vlm's glm4v_moe, loaded in" in result.stderr
    assert patched_row(result.stdout) == ("yes", "SwitchGLU[vlm] decode: reference; SwitchGLU[vlm] prefill: reference")


def test_demo_refuses_a_family_or_bits_with_a_checkpoint(tmp_path):
    for extra in (("--family", "qwen3_moe"), ("--bits", "4")):
        result = run_demo("--model", str(tmp_path), *extra)
        assert result.returncode == 2 and "--model takes neither --family nor --bits" in result.stderr


def test_demo_says_why_a_checkpoint_cannot_run(tmp_path):
    import json

    from mlx_lm.models.llama import Model, ModelArgs
    from mlx_lm.utils import save_config, save_model

    dense = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 128,
             "num_attention_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 256, "num_key_value_heads": 2}
    save_model(tmp_path / "dense", Model(ModelArgs.from_dict(dense)))
    save_config(dense, tmp_path / "dense" / "config.json")
    result = run_demo("--model", str(tmp_path / "dense"))
    assert result.returncode != 0 and "(mlx-lm's llama) has no expert (switch) layers" in result.stderr
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    mx.save_safetensors(str(tmp_path / "unknown" / "model.safetensors"), {"weight": mx.zeros(2)})
    result = run_demo("--model", str(tmp_path / "unknown"))
    assert result.returncode != 0 and "neither mlx-lm (Model type no_such_model not supported.) nor mlx-vlm (" in result.stderr


def test_demo_fetches_a_repo_that_is_not_a_folder(tmp_path, monkeypatch):
    import huggingface_hub

    from mlx_moe_fix import cli, zoo

    zoo.save_checkpoint("qwen3_moe", 4, tmp_path)
    fetched = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kwargs: fetched.append(repo) or str(tmp_path))
    model, prompt, what = cli.checkpoint_model("some-org/some-moe-4bit", 40)
    assert fetched == ["some-org/some-moe-4bit"] and "mlx-lm's qwen3_moe" in what
    assert len(prompt) == 40 and zoo.moe_layers(model)
