"""Drop-in nn.Modules backed by fastattn's fused ops."""
from .attention import MultiheadAttention
from .positional import (LearnedPositionalEmbedding, PositionalEmbedding, RotaryEmbedding,
                         SinusoidalPositionalEncoding)

__all__ = ["MultiheadAttention", "SinusoidalPositionalEncoding", "LearnedPositionalEmbedding", "PositionalEmbedding",
           "RotaryEmbedding"]
