"""The torch engine: a Llama-style model over a paged KV pool.

The scheduler's entry points are :class:`Engine` (build, ``step``/``prefill``/``decode``,
``close``), the request types in :mod:`.batch`, and :mod:`.sampling`.
"""

from cachepoint.engine.batch import DecodeRequest, PrefillRequest, StepOutput
from cachepoint.engine.config import EngineConfig, ModelConfig
from cachepoint.engine.engine import Engine
from cachepoint.engine.generate import BlockAllocator, GenerationRequest, GenerationResult
from cachepoint.engine.kv_pool import KVBudgetError, KVPool
from cachepoint.engine.sampling import SamplingParams, StopChecker, sample
from cachepoint.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "BlockAllocator",
    "ByteTokenizer",
    "DecodeRequest",
    "Engine",
    "EngineConfig",
    "GenerationRequest",
    "GenerationResult",
    "HFTokenizer",
    "KVBudgetError",
    "KVPool",
    "ModelConfig",
    "PrefillRequest",
    "SamplingParams",
    "StepOutput",
    "StopChecker",
    "Tokenizer",
    "load_tokenizer",
    "sample",
]
