"""Drop-in nn.Modules backed by fastattn's fused ops."""
from .additive_attention import AdditiveAttention
from .attention import MultiheadAttention
from .positional import (LearnedPositionalEmbedding, PositionalEmbedding, RotaryEmbedding,
                         SinusoidalPositionalEncoding)

__all__ = ["AdditiveAttention", "MultiheadAttention", "SinusoidalPositionalEncoding", "LearnedPositionalEmbedding", "PositionalEmbedding",
           "RotaryEmbedding"]
