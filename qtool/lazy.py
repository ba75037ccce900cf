"""`torch = lazy_module("torch")`: a module name bound at import time, imported at its first attribute use.

The format and packing modules compute with torch but are also read by commands that only look at headers
(`inspect`, `select`, the CLI's format list): importing them must not cost torch's start-up. Module-level
values built from torch (dtype tables, index tensors) are therefore functions, and annotations are strings
(`from __future__ import annotations`).
"""

from __future__ import annotations

import importlib
import types


class LazyModule(types.ModuleType):
    """Stands in for a module until an attribute is read, then forwards every read to the real one (never
    copied: a test that patches the real module's attribute sees its patch here too)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._lazy_target: types.ModuleType | None = None

    def __getattr__(self, attr: str):
        target = self._lazy_target
        if target is None:
            target = self._lazy_target = importlib.import_module(self.__name__)
        return getattr(target, attr)


def lazy_module(name: str) -> types.ModuleType:
    return LazyModule(name)
