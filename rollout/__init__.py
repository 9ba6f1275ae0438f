"""meshppo's generation engine: tensor-parallel, paged KV cache, continuous batching.

    from rollout import LLMEngine, EngineConfig, SamplingParams, RequestOutput

See `rollout/engine.py` for the loop, `rollout/config.py` for the options and for what the
returned log-probabilities are.
"""

import importlib

_EXPORTS = {
    "rollout.config": ("Continuation", "EngineConfig", "RequestOutput", "SamplingParams"),
    "rollout.engine": ("LLMEngine",),
    "rollout.model": ("ParamSlot",),
}

__all__ = ["Continuation", "EngineConfig", "LLMEngine", "ParamSlot", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    """PEP 562: a name of `__all__` is imported from its module on first use, so that importing one
    light module of `rollout` (or `rollout` itself) does not load the heavy ones."""
    for module, names in _EXPORTS.items():
        if name in names:
            value = globals()[name] = getattr(importlib.import_module(module), name)
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
