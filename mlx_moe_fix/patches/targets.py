"""What a patch target is."""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Target:
    module: str
    cls: str
    method: str
    wrapper: Callable
    # A wrapper that restates the method: the first 16 hex digits of the sha1 of the source it
    # restates (source_digest()); another version is left as it is.
    source_digest: Optional[str] = None

    @property
    def name(self) -> str:
        return f"{self.module}.{self.cls}.{self.method}"


def source_digest(function) -> Optional[str]:
    """The first 16 hex digits of the sha1 of `function`'s source, or None where Python cannot
    read it."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return None
    return hashlib.sha1(source.encode()).hexdigest()[:16]
