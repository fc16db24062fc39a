"""The random-weight model's configuration: its presets, shaped for a tokenizer.

Both engines serve the same random model: the torch engine builds it from this config
(api/app.py) and vLLM loads it exported once (vllm_engine/checkpoint.py). Unlike
random_model.py (the tokenizer choice and context length, read by the settings before
any engine exists) this needs the engine's `ModelConfig`.
"""

from __future__ import annotations

from collections.abc import Callable

from cachepoint.engine.config import ModelConfig
from cachepoint.replica.random_model import RANDOM_CONTEXT
from cachepoint.tokenizer import Tokenizer


def random_model(preset: str, tokenizer: Tokenizer) -> ModelConfig:
    """A random preset shaped for ``tokenizer``: its vocabulary, BOS and EOS."""
    return PRESETS[preset](
        vocab_size=tokenizer.vocab_size,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        max_position_embeddings=RANDOM_CONTEXT,
    )


# NOTE: "small" makes prefill cost visible on a CPU (benchmarks, demos) while still
# starting in seconds; "tiny" keeps tests fast. Both take RANDOM_CONTEXT positions.
PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "tiny": ModelConfig.tiny,
    "small": lambda **kw: ModelConfig.tiny(
        num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4, intermediate_size=768, **kw
    ),
}
