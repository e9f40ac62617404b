"""Drop-in nn.Modules backed by fastattn's fused ops."""

from .additive_attention import AdditiveAttention
from .attention import MultiheadAttention
from .gru import GRU, GRUCell
from .lstm import LSTM, LSTMCell
from .luong_attention import LuongAttention
from .paged_kv_cache import PagedKVCache
from .positional import (
    LearnedPositionalEmbedding,
    PositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
)
from .rnn import RNN, RNNCell

__all__ = [
    "AdditiveAttention",
    "LuongAttention",
    "MultiheadAttention",
    "PagedKVCache",
    "LSTM",
    "LSTMCell",
    "GRU",
    "GRUCell",
    "RNN",
    "RNNCell",
    "SinusoidalPositionalEncoding",
    "LearnedPositionalEmbedding",
    "PositionalEmbedding",
    "RotaryEmbedding",
]
