"""What a patch target is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Target:
    module: str
    cls: str
    method: str
    wrapper: Callable

    @property
    def name(self) -> str:
        return f"{self.module}.{self.cls}.{self.method}"
