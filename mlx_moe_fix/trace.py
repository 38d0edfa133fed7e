"""Which path each patched call took (kernel, reference or stock) and why.

Every call is counted (`path_counts()`); with MLX_MOE_FIX_TRACE=1 the first call of each
(layer kind, shape class, path) is also logged to stderr.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, NamedTuple

from .env import flag

logger = logging.getLogger("mlx_moe_fix")


class PathRecord(NamedTuple):
    layer: str
    phase: str
    path: str
    reason: str


_counts: Counter = Counter()
_logged: set = set()


def record(layer: str, phase: str, path: str, reason: str, shape_class: Callable[[], tuple]) -> None:
    """shape_class is called only when tracing, to keep the per-call cost off the hot path."""
    _counts[PathRecord(layer, phase, path, reason)] += 1
    if not flag("MLX_MOE_FIX_TRACE"):
        return
    shape = shape_class()
    key = (layer, shape, path)
    if key in _logged:
        return
    _logged.add(key)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[mlx-moe-fix] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    logger.info("%s %s %s -> %s (%s)", layer, phase, shape, path, reason)


def replay(records: Counter) -> None:
    """Count `records` ({PathRecord: calls}, calls > 0) again: the calls a compiled step made
    when traced."""
    _counts.update(records)


def restore(counts: dict) -> None:
    """Put the counts back to `counts` (an earlier path_counts())."""
    _counts.clear()
    _counts.update(counts)


def path_counts() -> dict:
    """{PathRecord(layer, phase, path, reason): calls} since the last reset."""
    return dict(_counts)


def reset_path_counts() -> None:
    _counts.clear()
    _logged.clear()
