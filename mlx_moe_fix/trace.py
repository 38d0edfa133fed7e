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
# Compiled steps' replayed records, counted into _counts when read: a replay runs per layer and
# decode step, and Counter.update costs more host time than the list append.
_replayed: list = []
_FOLD_REPLAYED_AT = 4096


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
    _replayed.append(records)
    if len(_replayed) >= _FOLD_REPLAYED_AT:
        _fold_replayed()


def _fold_replayed() -> None:
    by_id = {id(records): records for records in _replayed}
    for key, times in Counter(map(id, _replayed)).items():
        for path, calls in by_id[key].items():
            _counts[path] += calls * times
    _replayed.clear()


def restore(counts: dict) -> None:
    """Put the counts back to `counts` (an earlier path_counts())."""
    _replayed.clear()
    _counts.clear()
    _counts.update(counts)


def path_counts() -> dict:
    """{PathRecord(layer, phase, path, reason): calls} since the last reset."""
    _fold_replayed()
    return dict(_counts)


def reset_path_counts() -> None:
    _replayed.clear()
    _counts.clear()
    _logged.clear()
