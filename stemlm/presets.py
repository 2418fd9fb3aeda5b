"""Named model shapes. Each combines with any FFN kind and placement via ``model_config``."""

from __future__ import annotations

from .config import ConfigError, ModelConfig

PRESETS: dict[str, dict] = {
    # Runs every code path on CPU in seconds; used by the tests.
    "debug": dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=512, max_seq_len=128),
    # Trains on 2 CPU cores in minutes.
    "tiny": dict(d_model=256, n_layers=6, n_heads=8, n_kv_heads=4, d_ff=688, vocab_size=4096, max_seq_len=256),
    "mobilellm-350m": dict(d_model=960, n_layers=32, n_heads=15, n_kv_heads=5, d_ff=2560, vocab_size=32000,
                           max_seq_len=2048),
    # rope_theta as in Llama 3.2; its long-context rope scaling is not modelled.
    "llama3.2-1b": dict(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192, vocab_size=128256,
                        rope_theta=500000.0, max_seq_len=4096),
    # The shape of the real SmolLM2-135M checkpoint (tied embeddings as in that checkpoint).
    "smollm2-135m": dict(d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536, vocab_size=49152,
                         rope_theta=100000.0, max_seq_len=2048, tie_embeddings=True),
}


def model_config(preset: str = "debug", **overrides) -> ModelConfig:
    """The ``ModelConfig`` of a preset, with constructor fields overridden (e.g. ``ffn="stem"``)."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return ModelConfig.from_dict({**PRESETS[preset], **overrides})
