"""Which side is wrong where a zoo model's patched logits part from stock's: every MoE layer's
stock output against the same layer patched and against stock on the CPU, on identical inputs.

    python3 -m benchmarks.layer_parity --families deepseek_v3,deepseek_v4,inkling --bits 4

The model (bf16 on the GPU, as the greedy test runs it) prefills the zoo prompt once, unpatched,
while every MoE layer's inputs are recorded. Each recorded call is then replayed: stock again,
patched (whatever `status()` says the ops run), and stock on the CPU stream. The prompt's last
logits are compared the same way (GPU stock twice, patched, CPU stock). A layer where stock
differs from itself or from the CPU while the patched output agrees with the CPU points at the
upstream kernel, not at this package.
"""

import argparse

import mlx.core as mx

import mlx_moe_fix
from mlx_moe_fix import zoo

from .timing import markdown_table, relative_error


def last_logits(model, family: str) -> mx.array:
    out = zoo.prompt_logits(model, family)
    mx.eval(out)
    return out


def compare(family: str, bits: int) -> list:
    model = zoo.build(family, bits, dtype=mx.bfloat16)
    mlx_moe_fix.revert()
    with zoo.recording_layer_calls(model) as calls:
        stock_logits = last_logits(model, family)
    rows = []
    for number, (layer, args, kwargs) in enumerate(calls):
        stock = layer(*args, **kwargs)
        again = layer(*args, **kwargs)
        with mx.stream(mx.cpu):
            cpu = layer(*args, **kwargs)
            mx.eval(cpu)
        with mlx_moe_fix.patched():
            patched = layer(*args, **kwargs)
        mx.eval(stock, again, patched)
        x, indices = args[0], args[1]
        rows.append([f"{family}-{bits} layer call {number}", f"{tuple(x.shape)} k={indices.shape[-1]}",
                     f"{relative_error(again, stock):.1e}", f"{relative_error(stock, cpu):.1e}",
                     f"{relative_error(patched, cpu):.1e}", f"{relative_error(patched, stock):.1e}"])
    stock_again = last_logits(model, family)
    with mx.stream(mx.cpu):
        cpu_logits = last_logits(model, family)
    with mlx_moe_fix.patched():
        patched_logits = last_logits(model, family)
    rows.append([f"{family}-{bits} prompt logits", "", f"{relative_error(stock_again, stock_logits):.1e}",
                 f"{relative_error(stock_logits, cpu_logits):.1e}", f"{relative_error(patched_logits, cpu_logits):.1e}",
                 f"{relative_error(patched_logits, stock_logits):.1e}"])
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="deepseek_v3,deepseek_v4,inkling")
    parser.add_argument("--bits", default="4", help="comma-separated")
    args = parser.parse_args(argv)
    print(f"MLX {mx.__version__}, {mx.default_device()}, ops: "
          f"{ {name: op['path'] for name, op in mlx_moe_fix.status()['ops'].items()} }", flush=True)
    columns = ["what", "input", "stock vs stock", "stock vs CPU stock", "patched vs CPU stock", "patched vs stock"]
    rows = []
    for family in args.families.split(","):
        for bits in map(int, args.bits.split(",")):
            case = compare(family, bits)
            rows += case
            print(markdown_table(columns, case), flush=True)
    print(markdown_table(columns, rows))


if __name__ == "__main__":
    main()
