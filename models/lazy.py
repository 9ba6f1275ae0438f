"""Re-exports that a package's `__init__` imports on first use (PEP 562), so that importing the package, or one light
module of it, loads none of its heavy modules: `models` (the transformer, torch._dynamo through the tiled MLP),
`sharding` (FSDP) and `rollout` (the engine, triton). Reading and checking a config imports only light modules
(docs/ARCHITECTURE.md, "Import directions"; tests/unit/test_startup_imports.py)."""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]):
    """(`__getattr__`, `__all__`) for `package`'s `__init__`: `exports` maps each module to the names the package
    re-exports from it; a name is imported from its module when first read, then kept in the package."""
    namespace = sys.modules[package].__dict__
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(where[name]), name)
        return value

    return __getattr__, list(where)
