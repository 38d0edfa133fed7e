"""Short tables from what benchmarks/kernels.py and benchmarks/models.py write.

    python3 -m benchmarks.summary --tests /tmp/gpu-check/tests.log \\
        --kernels /tmp/gpu-check/kernels.json --models /tmp/gpu-check/models.json

scripts/gpu-check.sh prints this last. A missing or partial file (a part that timed out) is
reported as such rather than stopping the summary.
"""

import argparse
import json
import os
from typing import Any, Dict, List, Optional

from .timing import fmt, markdown_table


def cell(entry: Optional[Dict[str, Any]]) -> str:
    """Best tok/s with half the spread of the repeats."""
    if not entry:
        return "-"
    if "best" not in entry:
        return "skipped"
    spread = entry.get("spread")
    return fmt(entry["best"]) + (f" (±{spread / 2:.0%})" if spread is not None else "")


def models_table(rows: List[Dict[str, Any]]) -> str:
    return markdown_table(
        [
            "model",
            "tok/s",
            "stock",
            "patched",
            "patched/stock",
            "dense equivalent",
            "patched/dense",
            "stock/dense",
        ],
        [
            [
                r["model"],
                r["measure"],
                cell(r["stock"]),
                cell(r["patched"]),
                fmt(r["patched_over_stock"]),
                cell(r["dense"]),
                fmt(r["patched_over_dense"]),
                fmt(r["stock_over_dense"]),
            ]
            for r in rows
        ],
    )


def parity_lines(models: Dict[str, Any]) -> List[str]:
    lines = []
    for name, result in models.items():
        p = result.get("parity")
        if p is None:
            continue
        verdict = "identical" if p["identical"] else f"DIFFER from token {p['diverge_at']}"
        paths = result["modes"]["patched"].get("paths", {})
        lines.append(
            f"- {name}: first {p['tokens_compared']} greedy tokens stock vs patched {verdict}; "
            f"first-token logits rel err {p['first_logits_rel_err']:.1e}; patched calls: "
            + (", ".join(f"{k} x{v}" for k, v in paths.items()) or "none recorded")
        )
    return lines


def models_report(result: Dict[str, Any]) -> str:
    parts = [
        "Best tok/s of the repeats (± half the spread); ratios of the bests; batched decode "
        "counts all sequences.",
        models_table(result["summary"]),
    ]
    parts += parity_lines(result["models"])
    parts.append(
        "- memory, GB of weights / peak while building / peak overall: "
        + ", ".join(
            f"{name} {m['build']['weights_gb']:.1f} / {m['build']['peak_gb']:.1f} / "
            f"{m['peak_gb']:.1f}"
            for name, m in result["models"].items()
        )
    )
    return "\n".join(parts)


def kernels_report(result: Dict[str, Any]) -> str:
    """One row per (shape, T): the projection stock vs ours, and the whole SwitchGLU."""
    blocks = {(b["shape"], b["tokens"]): b for b in result.get("blocks", [])}
    rows = []
    for r in result["results"]:
        prefill = r["mode"] == "prefill"
        stock, ours = r["methods"][r["stock_method"]], r["methods"][r["ours_method"]]

        def show(m):
            return f"{fmt(m['tflops'])} TF/s" if prefill else f"{fmt(m['median_s'] * 1e6)} us"

        block = blocks.get((r["shape"], r["tokens"]))
        errors = list(r["rel_err"].values()) + (list(block["rel_err"].values()) if block else [])
        rows.append(
            [
                r["shape"],
                r["tokens"],
                show(stock),
                show(ours),
                fmt(r["speedup"]),
                fmt(block["speedup"]) if block else "-",
                f"{max(errors):.1e}" if errors else "-",
            ]
        )
    return markdown_table(
        ["shape", "T", "stock", "ours", "ours/stock", "SwitchGLU patched/stock", "max rel err"],
        rows,
    )


def tests_line(path: str) -> str:
    """scripts/pytest-shards.sh's closing line, each shard's pytest closing line ('shard 0/2: 12
    passed in 40.1s;shard 1/2: ...'); a log without it was cut short (gpu-check.sh kills the
    part at its limit), and its last line is only where one shard stood then."""
    with open(path) as f:
        lines = [line.strip() for line in f if line.strip()]
    if not lines:
        return "(empty log)"
    if not lines[-1].startswith("shard "):
        return f"INCOMPLETE (the shards' closing line is missing: the run was cut short); last line: {lines[-1]}"
    return lines[-1]


def load(path: str) -> Optional[Dict[str, Any]]:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tests", help="pytest log")
    p.add_argument("--kernels", help="JSON from benchmarks/kernels.py")
    p.add_argument("--models", help="JSON from benchmarks/models.py")
    args = p.parse_args(argv)

    out = []
    if args.tests:
        status = tests_line(args.tests) if os.path.exists(args.tests) else "no log"
        out.append(f"parity tests: {status}")
    for label, path, report in (
        ("kernels", args.kernels, kernels_report),
        ("models", args.models, models_report),
    ):
        if not path:
            continue
        result = load(path)
        if result is None:
            out.append(f"\n{label}: no JSON at {path} (see its log)")
            continue
        env = result["env"]
        out.append(f"\n{label} ({env['gpu']}, MLX {env['mlx']}, {env['date']}):")
        out.append(report(result))
    text = "\n".join(out)
    print(text)
    return text


if __name__ == "__main__":
    main()
