"""Our CUDA kernels' compiled code written into MLX's PTX cache, so that a process loads them
instead of compiling them (MLX_MOE_FIX_KERNEL_CACHE=0 turns it off; only on the MLX versions
whose kernel naming was checked, CHECKED_MLX_VERSIONS).

MLX 0.32.4 compiles every `mx.fast.cuda_kernel` variant with NVRTC in every process: a process's
first patched qwen3_moe prefill and decode token waited 13.8-17.2 s on the H200, the dense
equivalent's 0.5-2.1 s (docs/benchmarks.md, forty-fifth session, item 8). Its JIT module reads
MLX_PTX_CACHE_DIR for every module, custom kernels included, and only never writes custom
kernels there (mlx/backend/cuda/jit_module.cpp, custom_kernel.cpp; read, not run). So at a
variant's first call this rebuilds the source MLX generates for it (`build_kernel`: MLX's default
header, the header, the kernel in `mlx::core::cu` taking the inputs' and the outputs' pointers,
the template arguments as constants) and from it the module name MLX gives it (`custom_kernel_`,
the name, the template arguments' suffix, then the hex of libstdc++'s std::hash of that source);
where MLX's cache has no such module, it compiles the same kernel with NVRTC (through ctypes, the
library MLX loads, with MLX's options) from this package's own preamble in place of MLX's default
header (whose text lives only inside libmlx; tests/test_cuda_sources.py compiles the kernels
against the same preamble), and writes the cubin and its kernel's name as MLX's cache files. The
launch itself stays `mx.fast.cuda_kernel`'s: where a name does not match MLX's (another C++
library), MLX just compiles as without this.

On the H200 (docs/benchmarks.md, forty-sixth and forty-seventh sessions): a process's first
patched qwen3_moe prefill + token waited 0.22-0.38 s with the cache filled, against 8.8-18.8 s
without and 1.99-3.10 s while filling it (9.1-11.2 s before the fill used NVRTC's precompiled
header); the first token's log-probabilities were bitwise those of MLX's own compile in every
process, and the whole CUDA parity suite passed on the cached code, no variant left to MLX.
"""

from __future__ import annotations

import ctypes
import functools
import os
import tempfile
import threading
from pathlib import Path

import mlx.core as mx

from . import backend

SWITCH = "MLX_MOE_FIX_KERNEL_CACHE"

# The MLX versions whose custom-kernel module names this rebuilds, checked on a GPU (another
# version's naming may differ: there the fill would compile every kernel twice)
CHECKED_MLX_VERSIONS = ("0.32.4",)

# custom_kernel.cpp's default_header (the 0.32.4 libmlx holds this text)
MLX_DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
# What the kernels take from it: the half types, the fixed-width integers (NVRTC has no <cstdint>;
# libcu++'s defines them) and cooperative_groups.
PREAMBLE = "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cuda/std/cstdint>\n#include <cooperative_groups.h>\n"

# mlx/backend/cuda/utils.cpp dtype_to_cuda_type, and mlx/backend/common/compiled.cpp
# get_type_string (a template argument's part of the kernel's name)
CUDA_TYPES = {mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
              mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
              mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float", mx.float64: "double"}
TYPE_STRINGS = {**CUDA_TYPES, mx.float16: "float16_t", mx.bfloat16: "bfloat16_t"}

# jit_module.cpp get_ptx_path: a module name longer than this is split into directories
MAX_FILE_NAME = 245

_MASK = (1 << 64) - 1


def libstdcxx_hash(data: bytes, seed: int = 0xC70F6907) -> int:
    """std::hash<std::string> of libstdc++ on a 64-bit platform (_Hash_bytes, MurmurHash64A's
    variant there): what MLX names a custom kernel's module by."""
    mul = (0xC6A4A793 << 32) + 0x5BD1E995
    length, aligned = len(data), len(data) & ~7
    value = (seed ^ (length * mul)) & _MASK
    for start in range(0, aligned, 8):
        word = (int.from_bytes(data[start:start + 8], "little") * mul) & _MASK
        value = ((value ^ ((word ^ (word >> 47)) * mul & _MASK)) * mul) & _MASK
    if length & 7:
        value = ((value ^ int.from_bytes(data[aligned:], "little")) * mul) & _MASK
    value = ((value ^ (value >> 47)) * mul) & _MASK
    return value ^ (value >> 47)


def template_suffix(template: tuple) -> str:
    """custom_kernel.cpp template_arguments_hash: how MLX names a kernel's template variant."""
    return "".join(("_t" if value else "_f") if isinstance(value, bool) else
                   f"_{value}" if isinstance(value, int) else f"_{TYPE_STRINGS[value]}" for _, value in template)


def kernel_source(function: str, header: str, body: str, inputs: tuple, outputs: tuple, template: tuple,
                  preamble: str = MLX_DEFAULT_HEADER) -> str:
    """build_kernel's source of one variant: `inputs` and `outputs` as ((name, dtype), ...)."""
    parameters = [f"    const {CUDA_TYPES[dtype]}* {name},\n" for name, dtype in inputs]
    parameters += [f"    {CUDA_TYPES[dtype]}* {name}" for name, dtype in outputs]
    constants = "".join(
        f"  constexpr bool {name} = {'true' if value else 'false'};\n" if isinstance(value, bool) else
        f"  constexpr int {name} = {value};\n" if isinstance(value, int) else f"  using {name} = {CUDA_TYPES[value]};\n"
        for name, value in template)
    return (preamble + header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            f"__global__ void {function}(\n" + "".join(parameters[:len(inputs)]) + ",\n".join(parameters[len(inputs):])
            + ") {\n" + constants + ("\n" if constants else "") + body + "\n}\n\n} // namespace mlx::core::cu\n")


def module_name(function: str, source: str) -> str:
    return f"{function}_{libstdcxx_hash(source.encode()):x}"


def ptx_cache_directory() -> Path:
    """jit_module.cpp ptx_cache_dir: MLX_PTX_CACHE_DIR, else <temp>/mlx/<MLX's version>/ptx."""
    return Path(os.environ.get("MLX_PTX_CACHE_DIR") or Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx")


def ptx_path(directory: Path, module: str) -> Path:
    """jit_module.cpp get_ptx_path: <module>.ptx, a long name split into directories."""
    parts = [module[i:i + MAX_FILE_NAME] for i in range(0, len(module), MAX_FILE_NAME)] or [""]
    return directory.joinpath(*parts[:-1], parts[-1] + ".ptx")


class Unavailable(RuntimeError):
    """NVRTC, the CUDA driver or a compile is not to be had: MLX compiles the kernel itself."""


@functools.lru_cache(maxsize=None)
def _library(names: tuple):
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise Unavailable(f"none of {', '.join(names)} loads")


def nvrtc():
    # the soname MLX's libmlx links (loaded already in its process), then older and unversioned ones
    return _library(("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"))


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple:
    major, minor = ctypes.c_int(), ctypes.c_int()
    if nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)):
        raise Unavailable("nvrtcVersion failed")
    return major.value, minor.value


def compute_capability() -> tuple:
    """(major, minor) of MLX's GPU, as the launchers read it (backend.compute_capability)."""
    capability = backend.compute_capability()
    if capability is None:
        raise Unavailable("MLX gives no compute capability for its GPU")
    return capability


def include_directories() -> list:
    """jit_module.cpp include_path_args: the headers MLX's wheel ships (CCCL's among them), then
    the CUDA runtime's: its pip package's beside MLX's, else the toolkit's (CUDA_HOME, CUDA_PATH,
    /usr/local/cuda, with its CCCL)."""
    package = Path(mx.__file__).parent / "include"
    pip = [package.parent.parent / "nvidia" / runtime / "include" for runtime in ("cu13", "cuda_runtime")]
    home = Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda") / "include"
    return [str(path) for path in (package, package / "cccl", *pip, home / "cccl", home) if path.is_dir()]


def compile_options(capability: tuple, pch: bool = False) -> list:
    """jit_module.cpp compile's: device code by default, the GPU's SASS (sm_XYa from 9.0 on); and
    with `pch` NVRTC's automatic precompiled header (12.8+), which changes the compile's time, not
    its machine code: the process parses the first #include (cuda_bf16.h) once, not once a variant
    (docs/benchmarks.md, forty-sixth session, item 7, development CPU: five variants 6.0-6.3 s
    without, 4.0-4.1 s with, each cubin bit for bit the same, as tests/test_kernel_cache.py
    checks; forty-seventh session, item 1, H200: 8.5 against 4.1 s; there the code and data are the
    same but a few cuda::std constants and address-table slots come in another order, forty-eighth
    session item 1, which that test takes out: tests/cubin_elf.py)."""
    major, minor = capability
    return (["--device-as-default-execution-space", f"--gpu-architecture=sm_{major}{minor}{'a' if major >= 9 else ''}"]
            + [f"--include-path={d}" for d in include_directories()] + (["--pch"] if pch else []))


def has_pch() -> bool:
    try:
        return nvrtc_version() >= (12, 8)
    except Unavailable:
        return False


def _checked(result: int, what: str) -> None:
    if result:
        raise Unavailable(f"{what} failed (nvrtcResult {result})")


def compile_cubin(source: str, module: str, kernel: str, options: list) -> tuple:
    """(cubin, the lowered name of `kernel`) of `source` compiled by NVRTC, or Unavailable with its log."""
    library = nvrtc()
    program = ctypes.c_void_p()
    _checked(library.nvrtcCreateProgram(ctypes.byref(program), source.encode(), f"{module}.cu".encode(), 0, None, None),
             "nvrtcCreateProgram")
    try:
        _checked(library.nvrtcAddNameExpression(program, kernel.encode()), "nvrtcAddNameExpression")
        encoded = [option.encode() for option in options]
        if library.nvrtcCompileProgram(program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded)):
            size = ctypes.c_size_t()
            library.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            library.nvrtcGetProgramLog(program, log)
            raise Unavailable(f"NVRTC could not compile {module}: {log.value.decode(errors='replace').strip()[-2000:]}")
        lowered = ctypes.c_char_p()
        _checked(library.nvrtcGetLoweredName(program, kernel.encode(), ctypes.byref(lowered)), "nvrtcGetLoweredName")
        name = lowered.value.decode()
        size = ctypes.c_size_t()
        _checked(library.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _checked(library.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin.raw, name
    finally:
        library.nvrtcDestroyProgram(ctypes.byref(program))


def _write_whole(path: Path, data: bytes) -> None:
    """Written aside, then renamed into place: a reader never sees a part."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def fill(function: str, mlx_header: str, header: str, body: str, inputs: tuple, outputs: tuple, template: tuple,
         compile=compile_cubin) -> None:
    """Make sure MLX's PTX cache holds the variant of kernel `function` (MLX's name without its
    template suffix) that mx.fast.cuda_kernel builds from `mlx_header` (the header it was given)
    and `body` for these inputs, outputs and template: found there, or compiled and written; or
    Unavailable (OSError where the folder cannot be written)."""
    named = function + template_suffix(template)
    mlx_source = kernel_source(named, mlx_header, body, inputs, outputs, template)
    module = module_name(named, mlx_source)
    path = ptx_path(ptx_cache_directory(), module)
    if path.is_file():
        return
    kernel = f"mlx::core::cu::{named}"
    cubin, lowered = compile(kernel_source(named, header, body, inputs, outputs, template, PREAMBLE), module, kernel,
                             compile_options(compute_capability(), pch=has_pch()))
    path.parent.mkdir(parents=True, exist_ok=True)
    # the three files MLX writes for its own modules (scripts/ptx-cache.sh keeps only whole triples)
    _write_whole(path.with_suffix(".cu"), mlx_source.encode())
    _write_whole(path.with_suffix(".txt"), f"{kernel}\t{lowered}\n".encode())
    _write_whole(path, cubin)  # last: MLX takes a module whose .ptx exists
    written.append(module)


class CacheFilling:
    """An mx.fast.cuda_kernel object whose calls first make sure (fill) that MLX's PTX cache holds
    their variant; same call contract. A variant that cannot be filled is left to MLX's own
    compile, and `failures` says why."""

    def __init__(self, kernel, function: str, input_names: list, output_names: list, mlx_header: str, header: str,
                 body: str):
        self.kernel, self.function = kernel, function
        self.input_names, self.output_names = tuple(input_names), tuple(output_names)
        self.mlx_header, self.header, self.body = mlx_header, header, body
        self._seen: set = set()
        self._lock = threading.Lock()

    def __call__(self, *, inputs, template=(), output_dtypes, **launch):
        key = (tuple(template), tuple(a.dtype for a in inputs), tuple(output_dtypes))
        if key not in self._seen:
            with self._lock:
                if key not in self._seen:
                    try:
                        fill(self.function, self.mlx_header, self.header, self.body,
                             tuple(zip(self.input_names, key[1])), tuple(zip(self.output_names, key[2])), key[0])
                    except (Unavailable, OSError, KeyError) as error:  # KeyError: a dtype with no C type here
                        failures.append(f"{self.function}: {error}")
                    self._seen.add(key)
        return self.kernel(inputs=inputs, template=template, output_dtypes=output_dtypes, **launch)


failures: list = []  # why variants were left to MLX's compile, for state()
written: list = []  # the modules this process compiled into MLX's cache

# The first NVRTC compile of a process with `--pch` parses the preamble's headers and makes the
# precompiled header (1.3-1.5 s on the H200's host), each later one takes 0.09-0.13 s
# (docs/benchmarks.md, forty-seventh session, item 5): most of a filling process's wait.
# The names launch._kernel_name gives our kernels start with KERNEL_NAME_PREFIX; MLX names a custom
# kernel's module (and its symbol) custom_kernel_<name>.
KERNEL_NAME_PREFIX = "mlx_moe_fix_"
OUR_KERNEL_PREFIX = "custom_kernel_" + KERNEL_NAME_PREFIX
WARM_UP_KERNEL = OUR_KERNEL_PREFIX + "header_warm_up"
_warm_up: list = []  # the thread, once started


@functools.lru_cache(maxsize=None)
def _holds_our_modules(directory: Path) -> bool:
    """Looked at once a process and folder: apply() runs again at every patched() block and
    benchmark turn, and the folder holds thousands of MLX's modules."""
    return next(directory.glob(OUR_KERNEL_PREFIX + "*"), None) is not None


def warm_up_header(switched_on: bool) -> bool:
    """Where this process will likely fill the cache (it is on here and holds no module of this
    package yet: a machine's first process, or a new cache folder), compile an empty kernel with
    the fills' preamble and options in a thread, so that NVRTC's precompiled header is made
    while the caller goes on (apply() calls this: before a model loads); the first fill then
    compiles only its own code. Once a process; whether it started."""
    if _warm_up or not switched_on or backend.current_backend() != "cuda" or not naming_checked() or not has_pch():
        return False
    if _holds_our_modules(ptx_cache_directory()):
        return False
    try:
        options = compile_options(compute_capability(), pch=True)
    except Unavailable:
        return False
    source = kernel_source(WARM_UP_KERNEL, "", "", (), (("out", mx.float32),), (), PREAMBLE)
    _warm_up.append(compile_in_background(source, options))
    return True


def compile_in_background(source: str, options: list) -> threading.Thread:
    """The warm-up's compile, started in a thread. Not a daemon thread: a process that exited
    while NVRTC compiled in a daemon thread crashed (segmentation fault, 6 runs of 6 on the
    development CPU, docs/benchmarks.md forty-eighth session item 6), as `mlx-moe-fix status` on
    a machine's first process would; the interpreter waits for it instead (at most the compile's
    1.3-1.5 s)."""

    def compile_empty_kernel():
        try:
            compile_cubin(source, WARM_UP_KERNEL, f"mlx::core::cu::{WARM_UP_KERNEL}", options)
        except Unavailable:
            pass  # the fills then meet the same failure and report it (failures)

    thread = threading.Thread(target=compile_empty_kernel, name="mlx_moe_fix_nvrtc_warm_up")
    thread.start()
    return thread


def naming_checked() -> bool:
    return mx.__version__ in CHECKED_MLX_VERSIONS


def state(switched_on: bool) -> dict:
    if not switched_on:
        return {"on": False, "reason": f"{SWITCH}=0: MLX compiles each kernel in every process"}
    if not mx.cuda.is_available():
        return {"on": False, "reason": "no CUDA GPU here: no CUDA kernel of ours runs"}
    if not naming_checked():
        return {"on": False, "reason": f"MLX {mx.__version__}'s kernel naming is not checked (checked: "
                f"{', '.join(CHECKED_MLX_VERSIONS)}): MLX compiles each kernel in every process"}
    try:
        nvrtc_version()
    except Unavailable as error:
        return {"on": False, "reason": f"no NVRTC here ({error}): MLX compiles each kernel in every process"}
    reason = f"the kernels' compiled code kept in MLX's PTX cache ({ptx_cache_directory()})"
    if _warm_up:
        reason += "; NVRTC's precompiled header made at apply() (the cache held no module of this package)"
    if failures:
        reason += f"; {len(failures)} variants left to MLX's compile (first: {failures[0][:300]})"
    return {"on": True, "reason": reason}
