"""Shared helpers for the benchmarks: timing, progress, tables, JSON, environment.

Not a script; `benchmarks/kernels.py` and `benchmarks/models.py` import it:

    python3 -m benchmarks.kernels --smoke
    python3 -m benchmarks.models --smoke

Timing follows the method the baselines in shared/context/baseline-h200.md were measured
with: warm up at exactly the timed shapes (MLX JIT-compiles CUDA kernels per shape), then
time each repetition from before the graph is built until `mx.eval` + `mx.synchronize()`
return, and report the median with the min and max as spread.
"""

import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import mlx.core as mx

import mlx_moe_fix
from mlx_moe_fix.cli import markdown_table  # noqa: F401  re-exported for the benchmark scripts


@dataclass
class Stats:
    """Seconds per call over the timed repetitions. `build_median` is the part spent in the
    Python call that builds the (lazy) graph, before evaluation starts."""

    median: float
    min: float
    max: float
    reps: int
    build_median: float = 0.0
    times: List[float] = field(default_factory=list, repr=False)

    @property
    def spread(self) -> float:
        """(max - min) / median: how far apart repeated timings of the same thing land."""
        return (self.max - self.min) / self.median if self.median > 0 else math.inf

    @classmethod
    def from_times(cls, times: Sequence[float], builds: Sequence[float] = (0.0,)) -> "Stats":
        return cls(
            median=statistics.median(times),
            min=min(times),
            max=max(times),
            reps=len(times),
            build_median=statistics.median(builds),
            times=list(times),
        )


def mlx_finish(out: Any) -> None:
    """Wait until `out` (any tree of arrays, or None) is computed on the device."""
    if out is not None:
        mx.eval(out)
    mx.synchronize()


def warm_up(fn: Callable[[], Any], calls: int = 3) -> None:
    """`calls` evaluated calls of `fn` (which builds and returns arrays): at exactly the timed
    shapes, as MLX JIT-compiles CUDA kernels per shape."""
    for _ in range(calls):
        mx.eval(fn())
    mx.synchronize()


def build_and_evaluation(fn: Callable[[], Any]) -> tuple:
    """(seconds building, seconds evaluating) of one call of `fn`, which builds and returns arrays."""
    start = time.perf_counter()
    out = fn()
    built = time.perf_counter()
    mx.eval(out)
    mx.synchronize()
    return built - start, time.perf_counter() - built


def relative_error(out: mx.array, ref: mx.array) -> float:
    """||out - ref|| / ||ref||, in float32."""
    out, ref = out.astype(mx.float32), ref.astype(mx.float32)
    return (mx.linalg.norm(out - ref) / mx.linalg.norm(ref)).item()


def repeated(fn: Callable[[], Any], launches: int) -> Callable[[], List[Any]]:
    """`fn` built `launches` times into one graph: timing that spreads one `mx.eval` round trip
    over the launches, which single sub-millisecond kernels cannot afford (timed one per eval,
    identical kernels on the H200 came out up to 1.7x apart). Divide its times by `launches`."""
    return lambda: [fn() for _ in range(launches)]


def in_sequence(fn: Callable[[Any], Any], launches: int) -> Callable[[], List[Any]]:
    """`fn` built `launches` times into one graph, each launch after the previous one's output:
    `fn(after)` makes its input depend on the array `after` (None for the first launch; see
    `after`). Independent launches (`repeated`) may run side by side on the GPU, as no model's
    layers do. Divide its times by `launches`."""

    def launches_in_sequence():
        outputs = [fn(None)]
        for _ in range(launches - 1):
            outputs.append(fn(outputs[-1]))
        return outputs

    return launches_in_sequence


def after(a: mx.array, dependency: Optional[mx.array]) -> mx.array:
    """`a`, computed only after `dependency`, on the GPU too: `a` plus a zero taken from the
    dependency's first element (an integer product, exact whatever that element holds), a new
    buffer that one elementwise pass writes after the dependency, as a model's norm writes its MoE
    block's input. MLX's CUDA graph orders a kernel after the kernels that wrote its inputs'
    buffers; `mx.depends` shares `a`'s buffer and orders only the host's evaluation, so launches
    chained through it ran side by side on the GPU (docs/benchmarks.md, seventy-third stop)."""
    if dependency is None:
        return a
    zero = dependency.reshape(-1)[:1].astype(mx.uint32) * 0
    return a + zero.astype(a.dtype)


def bench(
    fn: Callable[[], Any],
    warmup: int = 3,
    reps: int = 20,
    *,
    max_seconds: Optional[float] = None,
    min_reps: int = 3,
    finish: Callable[[Any], None] = mlx_finish,
) -> Stats:
    """Time `fn` (which builds and returns arrays) and return per-call statistics.

    The timed region covers building the graph, evaluating it and synchronizing, so host
    work that a fast path does per call (index bookkeeping, host syncs) is counted. The
    building part is also reported on its own (`Stats.build_median`): mlx-lm overlaps it with
    the device during decode, so at decode sizes the difference is what the device takes.

    `max_seconds` bounds slow cases (a stock MoE prefill can take half a second per call):
    warm-up stops after the first call once half the budget is spent, and timing stops once
    the budget is spent and at least `min_reps` repetitions are in. Fast cases run all
    `warmup` + `reps` calls.

    `finish` waits for the result; pass e.g. `lambda _: torch.cuda.synchronize()` for torch.
    """
    spent = 0.0
    for _ in range(max(1, warmup)):
        t0 = time.perf_counter()
        finish(fn())
        spent += time.perf_counter() - t0
        if max_seconds is not None and spent > max_seconds / 2:
            break
    times, builds = [], []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        finish(out)
        times.append(time.perf_counter() - t0)
        builds.append(t1 - t0)
        del out  # let the outputs go before the next call allocates its own
        if max_seconds is not None and sum(times) > max_seconds and len(times) >= min_reps:
            break
    return Stats.from_times(times, builds)


class Progress:
    """A plain-text progress line on stderr: `\\r`-updated on a terminal, one line per step
    otherwise (so logs written to files stay readable)."""

    def __init__(self, total: int, label: str):
        self.total = max(1, total)
        self.label = label
        self.done = 0
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def step(self, what: str = "") -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        line = (
            f"[{self.label}] {self.done}/{self.total} "
            f"{elapsed:6.1f}s elapsed, ~{eta:5.1f}s left  {what}"
        )
        if self.tty:
            end = "\n" if self.done >= self.total else ""
            sys.stderr.write("\r" + line[:160].ljust(160) + end)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def log(msg: str) -> None:
    """Status messages go to stderr so stdout holds only the result tables."""
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def take_path_counts() -> Dict[str, int]:
    """mlx_moe_fix's patched calls per phase and path (kernel, reference or stock, with the
    reason when not the kernel) since the last call, so that a patched number can be told
    apart from a fallback."""
    counts: Dict[str, int] = {}
    for record, calls in mlx_moe_fix.path_counts().items():
        key = f"{record.phase} {record.path}"
        if record.path != "kernel":
            key += f" ({record.reason})"
        counts[key] = counts.get(key, 0) + calls
    mlx_moe_fix.reset_path_counts()
    return counts


def fmt(value: Optional[float], digits: int = 3) -> str:
    """Format a number to `digits` significant digits; None (not measured) as a dash."""
    if value is None:
        return "-"
    if value == 0 or not math.isfinite(value):
        return str(value)
    magnitude = int(math.floor(math.log10(abs(value))))
    decimals = max(0, digits - 1 - magnitude)
    return f"{value:.{decimals}f}"


def write_json(path: str, obj: Any) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.write("\n")


def _version(module_name: str) -> Optional[str]:
    try:
        module = __import__(module_name)
    except Exception:
        return None
    return getattr(module, "__version__", "unknown")


def environment() -> Dict[str, Any]:
    """Where and with what the numbers were taken."""
    info: Dict[str, Any] = {}
    if hasattr(mx, "device_info"):
        try:
            info = dict(mx.device_info())
        except Exception as e:  # a backend without device info should not stop a benchmark
            info = {"error": repr(e)}
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "mlx": mx.__version__,
        "mlx_lm": _version("mlx_lm"),
        "default_device": str(mx.default_device()),
        "cuda": bool(getattr(mx, "cuda", None) and mx.cuda.is_available()),
        "gpu": info.get("device_name") or info.get("architecture"),
        "device_info": info,
        "argv": sys.argv,
    }
    return env


def environment_line(env: Dict[str, Any]) -> str:
    return (
        f"{env['gpu']} | device {env['default_device']} | MLX {env['mlx']} | "
        f"mlx-lm {env['mlx_lm']} | {env['date']}"
    )
