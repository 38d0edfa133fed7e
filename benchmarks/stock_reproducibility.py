"""Where a zoo model's own (unpatched) forward stops reproducing itself: every module call of two
identical prompt forwards, in call order, compared; the first module whose output differs while
its inputs did not is where upstream MLX is non-deterministic on this device.

    python3 -m benchmarks.stock_reproducibility --families deepseek_v3,deepseek_v4,inkling

On the H200 the prompt logits of two stock runs of these zoo models differ by 0.3-1.2 (and
inkling's go NaN) while each MoE layer, replayed on recorded inputs, is bit-for-bit stable
(benchmarks/layer_parity.py): this names the module to report upstream.
"""

import argparse

import mlx.core as mx
import mlx.nn as nn

from mlx_moe_fix import zoo

from .timing import markdown_table, relative_error

COLUMNS = ["model", "two untraced forwards: logits rel err", "first module whose output differs on equal inputs",
           "class", "inputs"]


def arrays_of(value) -> list:
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in arrays_of(v)]
    if isinstance(value, dict):
        return [a for v in value.values() for a in arrays_of(v)]
    return [a for v in vars(value).values() for a in arrays_of(v)] if hasattr(value, "__dict__") else []


def traced_forward(model, family: str) -> list:
    """(module path, input arrays, output arrays) of every module call of one prompt forward,
    each evaluated as it happens, in call order."""
    calls = []
    paths = {id(module): path for path, module in reversed(list(model.named_modules()))}

    def around(module, call, *args, **kwargs):
        inputs = arrays_of(args) + arrays_of(kwargs)
        mx.eval(inputs)
        inputs = [mx.array(a) for a in inputs]  # copies: a cache may be updated in place later
        out = call(*args, **kwargs)
        outputs = arrays_of(out)
        mx.eval(outputs)
        calls.append((paths[id(module)], inputs, [mx.array(a) for a in outputs]))
        return out

    with zoo.intercepting([module for _, module in model.named_modules()], around):
        mx.eval(zoo.prompt_logits(model, family))
    return calls


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and mx.array_equal(x, y, equal_nan=True).item()
                                    for x, y in zip(a, b))


def first_divergence(family: str, bits: int) -> list:
    """One table row. Tracing evaluates every module call on its own, which may hide a race that
    the whole graph shows: the untraced comparison says whether there is one to find."""
    model = zoo.build(family, bits, dtype=mx.bfloat16)
    untraced = f"{relative_error(zoo.prompt_logits(model, family), zoo.prompt_logits(model, family)):.2e}"
    first, second = traced_forward(model, family), traced_forward(model, family)
    if [c[0] for c in first] != [c[0] for c in second]:
        return [f"{family}-{bits}", untraced, "module calls differ in order", "", ""]
    for (path, inputs, outputs), (_, inputs_again, outputs_again) in zip(first, second):
        if same(inputs, inputs_again) and not same(outputs, outputs_again):
            module = model
            for part in filter(None, path.split(".")):
                module = module[int(part)] if isinstance(module, list) else module[part]
            kind = type(module).__qualname__ if isinstance(module, nn.Module) else "?"
            shapes = ", ".join(str(tuple(a.shape)) + str(a.dtype).replace("mlx.core.", " ") for a in inputs)
            return [f"{family}-{bits}", untraced, path or "(model)", kind, shapes]
    return [f"{family}-{bits}", untraced, "none: every module call identical when evaluated one by one", "", ""]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="deepseek_v3,deepseek_v4,inkling")
    parser.add_argument("--bits", default="4")
    args = parser.parse_args(argv)
    print(f"MLX {mx.__version__}, {mx.default_device()}", flush=True)
    rows = []
    for family in args.families.split(","):
        for bits in map(int, args.bits.split(",")):
            rows.append(first_divergence(family, bits))
            print(markdown_table(COLUMNS, rows[-1:]), flush=True)
    print(markdown_table(COLUMNS, rows))


if __name__ == "__main__":
    main()
