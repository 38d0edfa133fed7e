"""Which path each patched call took (kernel, reference or stock) and why.

Every call is counted (`path_counts()`); with MLX_MOE_FIX_TRACE=1 the first call of each
(layer kind, shape class, path) is also logged to stderr.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from typing import Callable, NamedTuple, Optional

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


# The experts of the routings made inside kernel launches (the routed decode kernels route in their
# gate+up launch, where no layer call shows them), for checks of a run's routing: a list while
# observing_routing() is on, else None.
_observed_routing: Optional[list] = None


@contextlib.contextmanager
def observing_routing():
    """Within the block, each routing that a kernel launch makes appends its experts ([..., k]
    uint32, in the launch's order) to the yielded list. Only calls built in Python are seen, not a
    compiled step's replay (patches.compiled.suspended() builds every call)."""
    global _observed_routing
    outer, _observed_routing = _observed_routing, []
    try:
        yield _observed_routing
    finally:
        _observed_routing = outer


def observe_routing(experts: Callable) -> None:
    """`experts()`'s array into the observing_routing() list, where one is on."""
    if _observed_routing is not None:
        _observed_routing.append(experts())
