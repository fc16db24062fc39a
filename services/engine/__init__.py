"""The torch engine: a Llama-style model over a paged KV pool.

The scheduler's entry points are :class:`Engine` (build, ``step``/``prefill``/``decode``,
``close``), the request types in :mod:`.batch`, and :mod:`.sampling`.
"""

from .batch import DecodeRequest, PrefillRequest, StepOutput
from .config import EngineConfig, ModelConfig
from .engine import Engine
from .generate import BlockAllocator, GenerationRequest, GenerationResult
from .kv_pool import KVBudgetError, KVPool
from .sampling import SamplingParams, StopChecker, sample
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

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
