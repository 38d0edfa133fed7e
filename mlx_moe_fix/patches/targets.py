"""What a patch target is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Target:
    module: str
    cls: str
    method: str
    wrapper: Optional[Callable]  # None: known, deliberately left on stock code
    note: str = ""  # for wrapper None: why

    @property
    def name(self) -> str:
        return f"{self.module}.{self.cls}.{self.method}"
