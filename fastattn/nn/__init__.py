"""Drop-in nn.Modules backed by fastattn's fused ops."""
from .lstm import LSTM, LSTMCell
from .positional import (LearnedPositionalEmbedding, PositionalEmbedding, RotaryEmbedding,
                         SinusoidalPositionalEncoding)

__all__ = ["SinusoidalPositionalEncoding", "LearnedPositionalEmbedding", "PositionalEmbedding",
           "RotaryEmbedding", "LSTM", "LSTMCell"]
