"""Session 33 (docs/benchmarks.md, thirty-third session, item 2): the host cost of one custom kernel
node by its input count: build (eager call, or an mx.compile replay) and submission (mx.async_eval),
chains of 48 nodes, µs a node, medians of 55 rounds; a 4-bit QuantizedLinear node for scale.
    source .mlx-cuda/setup.sh && python3 docs/experiments/kernel_inputs_cost.py"""
import time, statistics
import mlx.core as mx

def kernel(n):
    names = ["y"] + [f"c{i}" for i in range(n - 1)]
    return mx.fast.cuda_kernel(name=f"probe_inputs_{n}", input_names=names, output_names=["out"],
                               source="unsigned int i = threadIdx.x; out[i] = y[i] + T(1);")

LAYERS, ROUNDS = 48, 60
rows = []
for n in (2, 5, 8, 11, 15):
    k = kernel(n)
    consts = [mx.ones((16,), dtype=mx.bfloat16) + i for i in range(n - 1)]
    mx.eval(consts)
    def node(y):
        return k(inputs=[y, *consts], template=[("T", mx.bfloat16)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                 output_shapes=[(16,)], output_dtypes=[mx.bfloat16])[0]
    compiled = mx.compile(node)
    for label, f in (("eager", node), ("compiled", compiled)):
        builds, submits = [], []
        for r in range(ROUNDS):
            y = mx.zeros((16,), dtype=mx.bfloat16); mx.eval(y)
            t0 = time.perf_counter()
            for _ in range(LAYERS):
                y = f(y)
            t1 = time.perf_counter()
            mx.async_eval(y)
            t2 = time.perf_counter()
            mx.eval(y)
            if r >= 5:
                builds.append((t1 - t0) / LAYERS * 1e6); submits.append((t2 - t1) / LAYERS * 1e6)
        rows.append((n, label, statistics.median(builds), statistics.median(submits)))
# reference: a 4-bit QuantizedLinear node
import mlx.nn as nn
lin = nn.QuantizedLinear(2048, 2048, bits=4, group_size=64); mx.eval(lin.parameters())
builds, submits = [], []
for r in range(ROUNDS):
    y = mx.zeros((1, 2048), dtype=mx.float32); mx.eval(y)
    t0 = time.perf_counter()
    for _ in range(LAYERS):
        y = lin(y)
    t1 = time.perf_counter(); mx.async_eval(y); t2 = time.perf_counter(); mx.eval(y)
    if r >= 5:
        builds.append((t1 - t0) / LAYERS * 1e6); submits.append((t2 - t1) / LAYERS * 1e6)
rows.append(("qlinear", "eager", statistics.median(builds), statistics.median(submits)))
print("| inputs | call | build µs/node | submit µs/node |\n|---|---|---|---|")
for n, label, b, s in rows:
    print(f"| {n} | {label} | {b:.2f} | {s:.2f} |")
