"""Every CUDA kernel launch the patched prefill and decode paths make, recorded on any machine (no
GPU): the CUDA path taken and each kernel object replaced by a recorder of its call (kernel with its
shared memory and launch bounds, inputs' shapes and dtypes and the values of small ones, templates,
grid, block, outputs). For refactors of the launchers that must not change what the GPU is given:
record before and after, compare.

    PYTHONPATH=. python scripts/record_launches.py /tmp/before.json   # (on the old commit)
    PYTHONPATH=. python scripts/record_launches.py /tmp/after.json
    cmp /tmp/before.json /tmp/after.json

Cases: each zoo family at 4 and 8 bits (a 40-token prompt, then one token, through the patched
model), direct moe_prefill_kernel calls (SwitchMLP experts, a scaled GLU, a GLU with biases, a lone
projection; with and without routing weights), and direct decode calls at top-k 2 and 8 (4 and 8
bits; bf16, fp16, fp32; moe_decode_kernel with and without routing weights, moe_routed_decode_kernel).
Compiled calls are off, so that every call is built."""

import json
import os
import sys

import mlx.core as mx
import numpy as np

os.environ["MLX_MOE_FIX_COMPILED_PREFILL"] = "0"
os.environ["MLX_MOE_FIX_COMPILED_DECODE"] = "0"
sys.path.insert(0, "tests")

import mlx_moe_fix  # noqa: E402
from mlx_moe_fix import zoo  # noqa: E402
from mlx_moe_fix.kernels import MoEExperts  # noqa: E402
from mlx_moe_fix.kernels.launch import absent  # noqa: E402
from parity.cases import make_case  # noqa: E402

calls = []


def described(a):
    if not isinstance(a, mx.array):
        return repr(a)
    out = {"shape": list(a.shape), "dtype": str(a.dtype)}
    if a.size <= 16:
        out["values"] = np.array(a.astype(mx.float32)).tolist()
    return out


class Recorder:
    """A kernel object's stand-in. Inputs that the kernel declares in its source (`constants`:
    launch.SourceConstants) are recorded in their places among the passed ones as the arrays they
    stand for (an absent input as the absent() placeholder), so that moving an input into the
    source leaves the record as it was."""

    def __init__(self, key, input_names=(), constants=()):
        self.key, self.input_names, self.constants = key, input_names, {c.name: c for c in constants}

    def __call__(self, *, inputs, template=(), grid, threadgroup, output_shapes, output_dtypes, **rest):
        calls.append({"kernel": self.key, "inputs": [described(a) for a in self.all_inputs(inputs)],
                      "template": [(k, str(v)) for k, v in template], "grid": list(grid),
                      "threadgroup": list(threadgroup), "output_shapes": [list(s) for s in output_shapes],
                      "output_dtypes": [str(d) for d in output_dtypes], "other": sorted(rest)})
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    def all_inputs(self, passed: list) -> list:
        if not self.constants:
            return passed
        passed = iter(passed)
        return [next(passed) if name not in self.constants else stand_in(self.constants[name]) for name in self.input_names]


def stand_in(constant) -> mx.array:
    if constant.values is None:
        return absent()
    return mx.array(constant.values, dtype=getattr(mx, constant.dtype))


def recorder(filename, section, input_names, output_names, shared, bounds=(), constants=()):
    return Recorder([filename, section, list(input_names), list(output_names), shared, list(bounds)], input_names, constants)


def launches_of(compute) -> list:
    """The launches that evaluating compute()'s arrays records."""
    calls.clear()
    mx.eval(compute())
    return list(calls)


def main(path):
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_moe_fix"):
            if hasattr(module, "current_backend"):
                module.current_backend = lambda: "cuda"
            if hasattr(module, "compute_capability"):
                module.compute_capability = lambda: (9, 0)  # the H200's
            if hasattr(module, "multiprocessor_count"):
                module.multiprocessor_count = lambda: 132  # the H200's
            if hasattr(module, "cuda_kernel_object"):
                module.cuda_kernel_object = recorder
    mlx_moe_fix.apply()
    recorded = {}
    for family in zoo.FAMILIES:
        for bits in (4, 8):
            model = zoo.build(family, bits, dtype=mx.bfloat16)
            for label, tokens in ((f"{family}-{bits}", 40), (f"{family}-{bits} decode", 1)):
                recorded[label] = launches_of(lambda: zoo.logits_of(model(mx.array([zoo.prompt_for(family, tokens)]))))
    prefill = sys.modules["mlx_moe_fix.kernels.moe_prefill"]
    for glu, kind, scaled, bias in ((False, "gelu", False, True), (True, "swiglu", True, False), (True, "swiglu_oai", False, True)):
        for with_weights in (False, True):
            case = make_case(mx.bfloat16, (4, 64), glu, kind, 7.0, scaled, 128, 256, 8, 2, 1, 48,
                             with_weights=with_weights, bias=bias)
            lone = MoEExperts(case.experts.projections[-1:])
            for label, experts, x in ((f"{glu}-{kind}-{scaled}-{bias}", case.experts, case.x),
                                      (f"lone-{glu}-{kind}", lone, mx.zeros((1, 48, lone.input_dims), mx.bfloat16))):
                recorded[f"direct {label}-{with_weights}"] = launches_of(
                    lambda: prefill.moe_prefill_kernel(x, case.indices, experts, case.weights))
    decode = sys.modules["mlx_moe_fix.kernels.moe_decode"]
    routed = sys.modules["mlx_moe_fix.kernels.moe_routed_decode"]
    from mlx_moe_fix.kernels import Routing
    for top_k in (2, 8):
        for bits in (4, 8):
            for dtype in (mx.bfloat16, mx.float16, mx.float32):
                case = make_case(dtype, (bits, 64), True, "swiglu", None, False, 256, 128, 8, top_k, 1, 1, with_weights=True)
                label = f"decode top-{top_k} {bits}-bit {dtype}"
                logits = mx.zeros((1, 1, 8), dtype)
                for name, call in (("unweighted", lambda: decode.moe_decode_kernel(case.x, case.indices, case.experts)),
                                   ("weighted", lambda: decode.moe_decode_kernel(case.x, case.indices, case.experts, case.weights)),
                                   ("routed", lambda: routed.moe_routed_decode_kernel(
                                       case.x, logits, Routing("softmax_topk", top_k, True), case.experts))):
                    recorded[f"direct {label} {name}"] = launches_of(call)
    with open(path, "w") as f:
        json.dump(recorded, f, indent=0, sort_keys=True)
    print(f"{sum(map(len, recorded.values()))} launches of {len(recorded)} cases written to {path}")


if __name__ == "__main__":
    main(sys.argv[1])
