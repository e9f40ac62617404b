"""Drop-in nn.Modules backed by fastattn's fused ops."""
from .additive_attention import AdditiveAttention
from .attention import MultiheadAttention
from .lstm import LSTM, LSTMCell
from .positional import (LearnedPositionalEmbedding, PositionalEmbedding, RotaryEmbedding,
                         SinusoidalPositionalEncoding)

__all__ = ["AdditiveAttention", "MultiheadAttention", "LSTM", "LSTMCell",
           "SinusoidalPositionalEncoding", "LearnedPositionalEmbedding", "PositionalEmbedding",
           "RotaryEmbedding"]
