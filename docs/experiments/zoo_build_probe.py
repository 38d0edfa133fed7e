"""Forty-sixth session (H200, docs/benchmarks.md item 6): where the demo's 10-13 s of "built in"
go: each step of mlx_moe_fix.zoo.build timed apart (the model class's import is `import mlx_lm`).
Run from the repo root: PYTHONPATH=. python3 docs/experiments/zoo_build_probe.py"""
import time
t = time.perf_counter()
def lap(what):
    global t
    now = time.perf_counter(); print(f"{what}: {now - t:.2f} s", flush=True); t = now
import mlx.core as mx
lap("import mlx")
mx.zeros(1).item(); lap("first GPU op (context)")
from mlx_moe_fix import zoo  # imports mlx_moe_fix
lap("import mlx_moe_fix, zoo")
config = zoo._config("qwen3_moe"); cls = zoo._model_class("qwen3_moe"); lap("model class import")
mx.random.seed(0); model = cls(config); lap("construct")
zoo._reinit(model, "qwen3_moe"); mx.eval(model.parameters()); lap("reinit + eval")
zoo._cast(model, mx.float32); mx.eval(model.parameters()); lap("cast + eval")
zoo._quantize(model, "qwen3_moe", zoo.GROUP_SIZE, 4); mx.eval(model.parameters()); lap("quantize + eval")
m2 = zoo.build("qwen3_moe", 4); lap("second build")
