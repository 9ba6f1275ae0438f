"""meshppo's generation engine: tensor-parallel, paged KV cache, continuous batching.

    from rollout import LLMEngine, EngineConfig, SamplingParams, RequestOutput

See `rollout/engine.py` for the loop, `rollout/config.py` for the options and for what the
returned log-probabilities are.
"""

from rollout.config import Continuation, EngineConfig, RequestOutput, SamplingParams
from rollout.engine import LLMEngine
from rollout.model import ParamSlot

__all__ = ["Continuation", "EngineConfig", "LLMEngine", "ParamSlot", "RequestOutput", "SamplingParams"]
