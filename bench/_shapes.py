"""Model shapes the benchmarks share (data only)."""

from __future__ import annotations

from workers.models import TinyModelConfig

SHAPES = {
    "tiny": TinyModelConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, intermediate_size=352, vocab_size=2048),
    "qwen2.5-0.5b": TinyModelConfig(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                    num_key_value_heads=2, head_dim=64, intermediate_size=4864, vocab_size=151936,
                                    rope_theta=1_000_000.0),
    "qwen2.5-1.5b": TinyModelConfig(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                    num_key_value_heads=2, head_dim=128, intermediate_size=8960, vocab_size=151936,
                                    rope_theta=1_000_000.0, tie_word_embeddings=True),
}
"""Model shapes the benchmarks build (random weights): ``tiny``; Qwen2.5-0.5B's
(630 M parameters with untied embeddings) and 1.5B's (1.54 B, tied)."""
