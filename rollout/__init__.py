"""meshppo's generation engine: tensor-parallel, paged KV cache, continuous batching.

    from rollout import LLMEngine, EngineConfig, SamplingParams, RequestOutput

See `rollout/engine.py` for the loop, `rollout/config.py` for the options and for what the
returned log-probabilities are.
"""

from models.lazy import lazy_exports

_EXPORTS = {
    "rollout.config": ("Continuation", "EngineConfig", "RequestOutput", "SamplingParams"),
    "rollout.engine": ("LLMEngine",),
    "rollout.model": ("ParamSlot",),
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
