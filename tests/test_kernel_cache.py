"""kernels/kernel_cache.py: the names and files of MLX's PTX cache as MLX computes them, filled
with kernels compiled here. No GPU here: what MLX then loads is for the GPU machine to show."""

import shutil
import subprocess
import sys

import mlx.core as mx
import pytest

from mlx_moe_fix import env
from mlx_moe_fix.kernels import kernel_cache
from tests.subprocess_env import repo_env


@pytest.fixture
def std_hash(tmp_path):
    """libstdc++'s std::hash<std::string> of bytes, from a program g++ builds (skipped without g++)."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ on this machine: libstdc++'s std::hash not at hand")
    source = tmp_path / "hash.cpp"
    source.write_text("#include <iostream>\n#include <iterator>\n#include <string>\nint main() {\n"
                      "  std::string s((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());\n"
                      "  std::cout << std::hash<std::string>{}(s) << std::endl;\n}\n")
    program = tmp_path / "hash"
    subprocess.run([compiler, "-O1", "-o", str(program), str(source)], check=True, capture_output=True)
    return lambda data: int(subprocess.run([str(program)], input=data, capture_output=True, check=True).stdout)


def test_libstdcxx_hash_is_gxx_std_hash(std_hash):
    samples = [b"", b"a", b"1234567", b"12345678", b"123456789", bytes(range(256)) * 3,
               kernel_cache.kernel_source("custom_kernel_k", "// header\n", "out[0] = a[0];", (("a", mx.float32),),
                                          (("out", mx.float32),), (("T", mx.bfloat16),)).encode()]
    for data in samples:
        assert kernel_cache.libstdcxx_hash(data) == std_hash(data), data[:40]


def test_kernel_source_is_mlx_build_kernels_layout():
    # custom_kernel.cpp build_kernel: default header, header, the kernel in mlx::core::cu with the
    # inputs' then the outputs' pointers, the template arguments as constants, the body
    text = kernel_cache.kernel_source(
        "custom_kernel_k_bfloat16_t_4_t", "#define H 1\n", "out[0] = x[0];",
        (("x", mx.bfloat16), ("dims", mx.int32)), (("out", mx.bfloat16), ("idx", mx.uint32)),
        (("T", mx.bfloat16), ("BITS", 4), ("GATED", True)))
    assert text == (
        '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
        "#define H 1\n"
        "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        "__global__ void custom_kernel_k_bfloat16_t_4_t(\n"
        "    const __nv_bfloat16* x,\n    const int32_t* dims,\n    __nv_bfloat16* out,\n    uint32_t* idx) {\n"
        "  using T = __nv_bfloat16;\n  constexpr int BITS = 4;\n  constexpr bool GATED = true;\n\n"
        "out[0] = x[0];\n}\n\n} // namespace mlx::core::cu\n")
    untemplated = kernel_cache.kernel_source("custom_kernel_k", "", "y[0] = 1;", (), (("y", mx.float32),), ())
    assert untemplated.endswith("__global__ void custom_kernel_k(\n    float* y) {\ny[0] = 1;\n}\n\n} // namespace mlx::core::cu\n")


def test_template_suffix_is_mlx_template_arguments_hash():
    template = (("T", mx.bfloat16), ("S", mx.float16), ("W", mx.float32), ("BITS", 4), ("GATED", True), ("LIMITED", False))
    assert kernel_cache.template_suffix(template) == "_bfloat16_t_float16_t_float_4_t_f"
    assert kernel_cache.template_suffix(()) == ""


def test_ptx_path_splits_long_module_names_as_mlx_does(tmp_path):
    assert kernel_cache.ptx_path(tmp_path, "m") == tmp_path / "m.ptx"
    name = "a" * 245 + "b" * 245 + "c" * 10
    assert kernel_cache.ptx_path(tmp_path, name) == tmp_path / ("a" * 245) / ("b" * 245) / ("c" * 10 + ".ptx")
    assert kernel_cache.ptx_path(tmp_path, "a" * 245) == tmp_path / ("a" * 245 + ".ptx")


@pytest.fixture
def ptx_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    monkeypatch.setattr(kernel_cache, "compute_capability", lambda: (9, 0))
    monkeypatch.setattr(kernel_cache, "written", [])
    return tmp_path / "ptx"


def test_fill_writes_the_module_mlx_looks_up_once(ptx_dir):
    compiled = []

    def fake_compile(source, module, kernel, options):
        compiled.append((source, module, kernel, options))
        return b"\x7fELF cubin", "_ZN3mlx4core2cu8mangledE"

    inputs, outputs, template = (("x", mx.float16),), (("y", mx.float16),), (("T", mx.float16), ("N", 3))
    args = ("custom_kernel_k", '#include "/h.cuh"\n', "// raw header\n", "y[0] = x[0];", inputs, outputs, template)
    kernel_cache.fill(*args, compile=fake_compile)
    mlx_source = kernel_cache.kernel_source("custom_kernel_k_float16_t_3", '#include "/h.cuh"\n', "y[0] = x[0];",
                                            inputs, outputs, template)
    module = f"custom_kernel_k_float16_t_3_{kernel_cache.libstdcxx_hash(mlx_source.encode()):x}"
    assert (ptx_dir / f"{module}.ptx").read_bytes() == b"\x7fELF cubin"
    assert (ptx_dir / f"{module}.txt").read_text() == "mlx::core::cu::custom_kernel_k_float16_t_3\t_ZN3mlx4core2cu8mangledE\n"
    assert (ptx_dir / f"{module}.cu").read_text() == mlx_source
    (source, compiled_module, kernel, options), = compiled
    # compiled from this package's preamble and the raw header, MLX's options for sm_90a
    assert source.startswith(kernel_cache.PREAMBLE + "// raw header\n") and "utils.cuh" not in source
    assert compiled_module == module and kernel == "mlx::core::cu::custom_kernel_k_float16_t_3"
    assert options[:2] == ["--device-as-default-execution-space", "--gpu-architecture=sm_90a"]
    assert ("--pch" in options) == kernel_cache.has_pch()
    kernel_cache.fill(*args, compile=fake_compile)
    assert len(compiled) == 1 and kernel_cache.written == [module]  # found: not compiled again


def test_cache_filling_fills_each_variant_once_and_leaves_failures_to_mlx(monkeypatch, ptx_dir):
    filled, launched = [], []

    def fake_fill(function, mlx_header, header, body, inputs, outputs, template):
        filled.append((inputs, template))
        if template == (("N", 2),):
            raise kernel_cache.Unavailable("no NVRTC")

    monkeypatch.setattr(kernel_cache, "fill", fake_fill)
    monkeypatch.setattr(kernel_cache, "failures", [])
    kernel = kernel_cache.CacheFilling(lambda **kwargs: launched.append(kwargs) or ["out"], "custom_kernel_k", ["x"],
                                       ["y"], "mlx header", "header", "body")
    x = mx.zeros((2,), mx.float16)
    for n in (1, 1, 2, 2):
        assert kernel(inputs=[x], template=[("N", n)], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(2,)],
                      output_dtypes=[mx.float16]) == ["out"]
    assert filled == [((("x", mx.float16),), (("N", 1),)), ((("x", mx.float16),), (("N", 2),))]
    assert len(launched) == 4 and launched[0]["grid"] == (1, 1, 1) and launched[0]["template"] == [("N", 1)]
    assert kernel_cache.failures == ["custom_kernel_k: no NVRTC"]


@pytest.fixture
def warm_up_conditions(monkeypatch, ptx_dir):
    """As on a CUDA machine with NVRTC 12.8+ and MLX's checked version; NVRTC's compile recorded."""
    compiled = []
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernel_cache.backend, "current_backend", lambda: "cuda")
    monkeypatch.setattr(kernel_cache, "CHECKED_MLX_VERSIONS", (mx.__version__,))
    monkeypatch.setattr(kernel_cache, "nvrtc_version", lambda: (13, 0))
    monkeypatch.setattr(kernel_cache, "has_pch", lambda: True)
    monkeypatch.setattr(kernel_cache, "compile_cubin", lambda *arguments: compiled.append(arguments) or (b"", ""))
    monkeypatch.setattr(kernel_cache, "_warm_up", [])
    return compiled


def test_the_header_is_warmed_up_once_where_the_cache_holds_none_of_our_modules(warm_up_conditions):
    assert kernel_cache.warm_up_header(True)
    kernel_cache._warm_up[0].join(timeout=30)
    ((source, module, kernel, options),) = warm_up_conditions
    assert source.startswith(kernel_cache.PREAMBLE) and "--pch" in options
    assert options == kernel_cache.compile_options((9, 0), pch=True)  # the fills' options: their header is this one
    assert kernel == f"mlx::core::cu::{kernel_cache.WARM_UP_KERNEL}"
    assert not kernel_cache.warm_up_header(True) and len(warm_up_conditions) == 1  # once a process
    assert "precompiled header made at apply()" in kernel_cache.state(True)["reason"]


def test_no_header_warm_up_where_a_module_of_ours_is_cached_or_the_cache_is_off(warm_up_conditions, ptx_dir):
    assert not kernel_cache.warm_up_header(False)
    ptx_dir.mkdir(parents=True, exist_ok=True)
    (ptx_dir / "custom_kernel_mlx_moe_fix_moe_router_topk_0123.ptx").write_bytes(b"")
    assert not kernel_cache.warm_up_header(True)
    assert warm_up_conditions == [] and kernel_cache._warm_up == []


def test_no_header_warm_up_where_the_default_device_is_the_cpu(warm_up_conditions, monkeypatch):
    monkeypatch.setattr(kernel_cache.backend, "current_backend", lambda: "cpu")
    assert not kernel_cache.warm_up_header(True) and warm_up_conditions == []


def test_a_process_exiting_during_the_warm_up_compile_exits_cleanly():
    # a daemon thread inside NVRTC when the interpreter finalised crashed the exit (rc -11)
    needs_pch()
    code = ("import mlx.core as mx\nfrom mlx_moe_fix.kernels import kernel_cache as k\n"
            "source = k.kernel_source(k.WARM_UP_KERNEL, '', '', (), (('out', mx.float32),), (), k.PREAMBLE)\n"
            "thread = k.compile_in_background(source, k.compile_options((9, 0), pch=True))\n"
            "import time\ntime.sleep(0.3)\n"  # into NVRTC's compile (1 s or more with the headers)
            "print(thread.is_alive())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=repo_env(), timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "True", (done.returncode, done.stderr[-2000:])


def needs_nvrtc():
    try:
        kernel_cache.nvrtc_version()
    except kernel_cache.Unavailable as error:
        pytest.skip(f"no NVRTC on this machine ({error})")


def needs_pch():
    needs_nvrtc()
    if not kernel_cache.has_pch():
        pytest.skip(f"NVRTC {kernel_cache.nvrtc_version()} has no automatic PCH (12.8+)")


def router_topk_variant(dtype, softmax_first: bool) -> tuple:
    """(template, inputs, outputs) of a variant of moe_router.cu's topk kernel, as fill takes them."""
    template = (("T", dtype), ("SOFTMAX_FIRST", softmax_first), ("NORMALIZE", softmax_first), ("LAST_K", True))
    return template, (("logits", dtype), ("sizes", mx.int32)), (("indices", mx.uint32), ("weights", dtype))


def test_fill_compiles_a_router_kernel_with_nvrtc(ptx_dir):
    needs_nvrtc()
    from mlx_moe_fix.kernels.launch import global_qualifiers
    from mlx_moe_fix.kernels.sources import cuda_kernel_source

    header, body = cuda_kernel_source("moe_router.cu", "topk")
    template, inputs, outputs = router_topk_variant(mx.bfloat16, True)
    kernel_cache.fill("custom_kernel_router", header, header + global_qualifiers(()), body, inputs, outputs, template)
    (ptx,) = ptx_dir.glob("custom_kernel_router_bfloat16_t_t_t_t_*.ptx")
    kernel, lowered = ptx.with_suffix(".txt").read_text().strip().split("\t")
    assert kernel == "mlx::core::cu::custom_kernel_router_bfloat16_t_t_t_t" and lowered.startswith("_ZN3mlx4core2cu")
    cubin = ptx.read_bytes()
    assert cubin[:4] == b"\x7fELF" and lowered.encode() in cubin


@pytest.mark.parametrize("switch, cuda, checked, nvrtc, on, says", [
    ("", True, ("0.0.0",), True, False, "not checked"),      # on by default, but only where MLX's naming was checked
    ("1", True, ("0.0.0",), True, False, "not checked"),
    ("0", True, None, True, False, "=0"),
    ("", False, None, True, False, "no CUDA GPU"),
    ("", True, None, False, False, "no NVRTC"),
    ("", True, None, True, True, "kept in MLX's PTX cache"),
])
def test_status_says_whether_the_cache_is_on_and_why(monkeypatch, switch, cuda, checked, nvrtc, on, says):
    import mlx_moe_fix

    def version():
        if not nvrtc:
            raise kernel_cache.Unavailable("none loads")
        return (13, 0)

    monkeypatch.setenv(kernel_cache.SWITCH, switch)
    monkeypatch.setattr(kernel_cache, "CHECKED_MLX_VERSIONS", checked or (mx.__version__,))
    monkeypatch.setattr(kernel_cache, "nvrtc_version", version)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: cuda)
    env.refresh()
    try:
        state = mlx_moe_fix.status()["cuda_kernel_cache"]
    finally:
        monkeypatch.undo()
        env.refresh()
    assert state["on"] is on and says in state["reason"]


def test_the_precompiled_header_leaves_every_cubin_as_it_was():
    """--pch is only for speed: the module MLX loads must be what its own compile would give: the
    same machine code and data. Not byte for byte: on the H200's NVRTC the symbol table can list
    the same symbols in another order (tests/cubin_elf.py)."""
    needs_pch()
    from mlx_moe_fix.kernels.sources import cuda_kernel_source
    from tests.cubin_elf import normalised

    header, body = cuda_kernel_source("moe_router.cu", "topk")
    variants = (router_topk_variant(mx.bfloat16, True), router_topk_variant(mx.float16, False))
    compiles = {template: [] for template, _, _ in variants}
    for pch in (False, True, True):  # the second with-PCH compile uses the header the first made
        for template, inputs, outputs in variants:
            source = kernel_cache.kernel_source("custom_kernel_k", header, body, inputs, outputs, template, kernel_cache.PREAMBLE)
            cubin, _ = kernel_cache.compile_cubin(source, "m", "mlx::core::cu::custom_kernel_k",
                                                  kernel_cache.compile_options((9, 0), pch=pch))
            compiles[template].append(normalised(cubin))
    plain = [built[0] for built in compiles.values()]
    assert all(any(name.startswith(".text.") and code for name, code in form["bytes"].items()) for form in plain)
    assert plain[0] != plain[1], "the comparison must tell two different kernels apart"
    for built in compiles.values():
        assert built[1] == built[0] and built[2] == built[0]
