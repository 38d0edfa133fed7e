"""Small pieces shared by the CUDA kernel launchers."""

from __future__ import annotations

import functools
import hashlib
import struct
from typing import NamedTuple, Optional

import mlx.core as mx

from ..env import flag
from . import kernel_cache
from .experts import FP4_GROUP_SIZES, MoEExperts
from .sources import cuda_header_directive, cuda_kernel_source, sections

# Activation kinds as the kernels' run-time `dims[3]` (see cuda/*.cu).
ACTIVATION_CODES = {"swiglu": 0, "swiglu_oai": 1, "gelu": 2, "gelu_approx": 3, "gelu_fast": 4, "swiglu_fp32": 5,
                    "swiglu_clamped_silu": 6, "geglu_approx": 7, "situ": 8, "relu2": 9,
                    "swiglu_capped_silu": 10}


class Launch(NamedTuple):
    """One kernel launch, all but its per-call inputs (activations, indices, routing weights);
    a call gives its outputs' list. A call may give its own `grid` and `output_shapes`, where
    they follow the call (the grouped prefill GEMM's tiles and rows)."""

    kernel: object
    fixed_inputs: list
    template: list
    grid: tuple
    threadgroup: tuple
    output_shapes: list
    output_dtypes: list

    def __call__(self, *varying_inputs, grid: Optional[tuple] = None, output_shapes: Optional[list] = None) -> list:
        return self.kernel(
            inputs=[*varying_inputs, *self.fixed_inputs],
            template=self.template,
            grid=self.grid if grid is None else grid,
            threadgroup=self.threadgroup,
            output_shapes=self.output_shapes if output_shapes is None else output_shapes,
            output_dtypes=self.output_dtypes,
        )


def _kernel_name(backend: str, filename: str, section: str, suffix: str = "", declarations: str = "") -> str:
    """A kernel's name with its source's digest: MLX keeps compiled kernels under their names (in
    the process; on disk, for CUDA, in MLX_PTX_CACHE_DIR as kernel_cache fills it: MLX 0.32.4
    writes none of ours there), so an edited source must not find its old build there."""
    if backend == "cuda":
        header, body = cuda_kernel_source(filename, section)
    else:
        source = sections(backend, filename)
        header, body = source["header"], source[section]
    digest = hashlib.sha1((header + declarations + body).encode()).hexdigest()[:12]
    return f"{kernel_cache.KERNEL_NAME_PREFIX}{filename.split('.')[0]}_{section}{suffix}_{digest}"


def global_qualifiers(bounds: tuple = ()) -> str:
    """Header lines that give the kernel MLX declares next `__launch_bounds__(threads,
    min_blocks)` (bounds = (threads, min_blocks): registers capped so that `min_blocks` blocks fit
    an SM): cuda_kernel writes the `__global__` signature itself, so the qualifier is redefined
    after the header. Only where `__global__` is the usual `__location__(global)` macro; elsewhere
    nothing changes."""
    if not bounds:
        return ""
    return ("#if defined(__global__) && defined(__location__)\n#undef __global__\n"
            f"#define __global__ __location__(global) __launch_bounds__({bounds[0]}, {bounds[1]})\n#endif\n")


def cuda_kernel_object(filename: str, section: str, input_names: tuple, output_names: tuple, shared_bytes: int,
                       bounds: tuple = (), constants: tuple = ()):
    """The mx.fast.cuda_kernel object of one section of cuda/`filename`, with `shared_bytes` of
    dynamic shared memory (fixed per object) and, given `bounds` = (threads, min_blocks),
    global_qualifiers; `constants` (SourceConstants) are inputs declared at the start
    of the kernel's body instead of passed; or None where MLX has no CUDA. Cached: each object is an
    NVRTC compile per template variant; unless MLX_MOE_FIX_KERNEL_CACHE=0 (or MLX's naming is
    unchecked) its calls first make sure their variant's compiled code is in MLX's PTX cache, so
    that only a machine's first process compiles it (kernel_cache.py)."""
    return _cuda_kernel_object(filename, section, input_names, output_names, shared_bytes, bounds, constants,
                               flag(kernel_cache.SWITCH) and kernel_cache.naming_checked())


@functools.lru_cache(maxsize=None)
def _cuda_kernel_object(filename: str, section: str, input_names: tuple, output_names: tuple, shared_bytes: int,
                        bounds: tuple, constants: tuple, fills_ptx_cache: bool):
    if not mx.cuda.is_available():
        return None
    header, body = cuda_kernel_source(filename, section)
    declarations = "".join(constant.declaration() for constant in constants)
    suffix = f"_smem{shared_bytes}" + (f"_lb{bounds[0]}x{bounds[1]}" if bounds else "")
    declared = {constant.name for constant in constants}
    name = _kernel_name("cuda", filename, section, suffix, declarations)
    passed = [input_name for input_name in input_names if input_name not in declared]
    mlx_header = cuda_header_directive(header) + global_qualifiers(bounds)
    kernel = mx.fast.cuda_kernel(
        name=name,
        input_names=passed,
        output_names=list(output_names),
        source=declarations + body,
        header=mlx_header,
        shared_memory=shared_bytes,
    )
    if not fills_ptx_cache:
        return kernel
    return kernel_cache.CacheFilling(kernel, f"custom_kernel_{name}", passed, list(output_names), mlx_header,
                                     header + global_qualifiers(bounds), declarations + body)


# Fixed inputs that a CUDA decode launch takes as constants of its source, with the absent optional
# inputs: each input a launch passes costs the host ~0.24 µs a call to replay and submit (H200's
# host, one custom kernel with 2 against 15 inputs: docs/benchmarks.md, thirty-third session), and a
# decode step makes two launches a layer. Not `dims`: the shape as constants let the compiler
# unroll the fp32 down's loops past its launch bounds (12 bytes spilled at 4 bits).
SOURCE_CONSTANTS = ("params",)


# The passed input that an absent input's pointer is made of: every decode launch passes its dims.
ABSENT_ALIAS = "dims"


class SourceConstant(NamedTuple):
    """An input declared in a kernel's source instead of passed: its float32 values, or None for an
    absent optional input, a pointer of the float32 placeholder's type that the kernel never reads. That pointer is ABSENT_ALIAS's, not a null one: told that an input is null, the
    compiler laid the combining down's registers out otherwise and spilled 12 bytes at 4 bits."""

    name: str
    dtype: Optional[str]
    values: Optional[tuple]

    def declaration(self) -> str:
        if self.values is None:
            return f"const float* {self.name} = reinterpret_cast<const float*>({ABSENT_ALIAS});\n"
        # by their bits: the kernel reads the very float32 values the array held
        bits = (struct.unpack("<i", struct.pack("<f", v))[0] for v in self.values)
        return f"const float {self.name}[] = {{{', '.join(f'__int_as_float({b})' for b in bits)}}};\n"


def source_constants(fixed: dict) -> tuple:
    """(SourceConstants for cuda_kernel_object, the arrays still passed, in order) of a CUDA
    launch's fixed inputs {name: array, or None where the optional input is absent}: the absent,
    and those in SOURCE_CONSTANTS (float32 arrays) by their values."""
    constants, arrays = [], []
    for name, array in fixed.items():
        if array is None:
            constants.append(SourceConstant(name, None, None))
        elif name in SOURCE_CONSTANTS:
            if array.dtype != mx.float32:
                raise TypeError(f"{name}: a {array.dtype} input cannot be a source constant (float32 only)")
            constants.append(SourceConstant(name, "float32", tuple(array.tolist())))
        else:
            arrays.append(array)
    return tuple(constants), arrays


def fixed_or_absent(fixed: dict) -> list:
    """A launch's fixed inputs as arrays, an absent one as the absent() placeholder (Metal)."""
    return [or_absent(array) for array in fixed.values()]


@functools.lru_cache(maxsize=None)
def metal_kernel_object(filename: str, section: str, input_names: tuple, output_names: tuple):
    """The mx.fast.metal_kernel object of one section of metal/`filename`, or None where MLX has
    no Metal. Cached: each object is a Metal library compile per template variant."""
    if not mx.metal.is_available():
        return None
    source = sections("metal", filename)
    return mx.fast.metal_kernel(
        name=_kernel_name("metal", filename, section),
        input_names=list(input_names),
        output_names=list(output_names),
        source=source[section],
        header=source["header"],
        ensure_row_contiguous=True,
    )


@functools.lru_cache(maxsize=None)
def absent() -> mx.array:
    """Stands in for an optional input the kernel does not read. An array with its data, not a
    lazy mx.zeros: a compiled decode step (patches/compiled.py) may create it while tracing, and
    the steps outside that trace use it too."""
    return mx.array([0.0], dtype=mx.float32)


def or_absent(array: Optional[mx.array]) -> mx.array:
    """An optional input of a launch, or the placeholder of an absent one."""
    return absent() if array is None else array


@functools.lru_cache(maxsize=4096)
def int_array(*values: int) -> mx.array:
    """Run-time integers for a kernel, cached so that a decode step builds no new arrays."""
    return mx.array(values, dtype=mx.int32)


@functools.lru_cache(maxsize=256)
def float_array(*values: float) -> mx.array:
    return mx.array(values, dtype=mx.float32)


def per_pair(weights: mx.array, indices: mx.array) -> mx.array:
    """Routing `weights` with one value per (token, expert) pair of `indices`, as the kernels read
    them: the references broadcast weights of fewer leading dimensions against the pairs, and so
    does this (a shape that cannot broadcast raises, as there)."""
    return weights if weights.shape == indices.shape else mx.broadcast_to(weights, indices.shape)


def kernel_dims(in_dim, out_dim, top_k, activation=None, has_bias=False, has_scale=False) -> mx.array:
    """The `dims` input of the kernels: IN_DIM, OUT_DIM, TOP_K, ACT, HAS_LIMIT, HAS_BIAS, HAS_SCALE."""
    act = ACTIVATION_CODES[activation.kind] if activation is not None else 0
    has_limit = activation is not None and activation.limit is not None
    return int_array(in_dim, out_dim, top_k, act, int(has_limit), int(has_bias), int(has_scale))


def bias_template(linear) -> tuple:
    """The HAS_BIAS template constant: MLX names a compiled kernel by its template arguments and
    not its inputs' dtypes, and an absent bias is passed as a float32 placeholder, so without it
    a kernel compiled for one bias signature would be reused for the other."""
    return ("HAS_BIAS", linear.bias is not None)


def kernel_params(activation) -> mx.array:
    """The `params` input: limit, alpha."""
    return float_array(activation.limit or 0.0, activation.alpha or 0.0) if activation is not None else float_array(0.0, 0.0)


def quantized_experts_reason(experts: MoEExperts, modes: tuple = ("affine",)):
    """Why the kernels cannot read these experts' weights, or None: they need every projection
    quantized in one of `modes` (the kernel's), with one dtype for the scales, and for affine
    projections their biases and additive biases."""
    first = experts.projections[0]
    for p in experts.projections:
        if not p.quantized:
            return "unquantized experts: the kernels read quantized weights"
        if p.mode not in modes:
            return f"{p.mode}-quantized experts: this kernel reads {' and '.join(modes)} weights only"
        if p.scales.dtype != first.scales.dtype or (p.mode == "affine" and p.bias is not None and p.bias.dtype != p.scales.dtype):
            return "projections with scales / bias of different dtypes"
    if len(experts.projections) == 3:
        gate, up = experts.projections[:2]
        if (gate.bias is None) != (up.bias is None):
            return "a bias on only one of gate and up"
        if (gate.mode, gate.bits, gate.group_size) != (up.mode, up.bits, up.group_size):
            return (f"gate ({gate.mode} {gate.bits}-bit, group {gate.group_size}) and up ({up.mode} {up.bits}-bit, group "
                    f"{up.group_size}) quantized differently: the gate+up kernels read both with one")
    scales = [s for s in (experts.gate_scale, experts.out_scale) if s is not None]
    if len({s.dtype for s in scales}) > 1:
        return "gate_scale and out_scale of different dtypes"
    return None


def fp4_activations_reason(experts: MoEExperts, dtype, dtypes: tuple) -> Optional[str]:
    """Why a kernel that reads mxfp4 / nvfp4 experts against activations of `dtypes` cannot take
    these experts against `dtype`, or None (also for experts without such projections): their
    additive biases must be of the activations' dtype (the kernels read them as such)."""
    fp4 = [p for p in experts.projections if p.mode in FP4_GROUP_SIZES]
    if fp4 and dtype not in dtypes:
        return (f"{fp4[0].mode} experts against {dtype} activations (this kernel reads them against "
                f"{' / '.join(map(str, dtypes))} only)")
    if any(p.bias is not None and p.bias.dtype != dtype for p in fp4):
        return f"an {fp4[0].mode} projection whose additive bias is not of the activations' dtype"
    return None
