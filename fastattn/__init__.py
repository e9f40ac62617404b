"""fastattn: fused CUDA, Triton and C++ CPU kernels for softmax attention, LSTMs and positional
encodings, with drop-in PyTorch modules.

The public API, documented in the docstrings and the docs/ pages:

- backends: `available_backends`, `use_backend`, `set_backend`, `last_backend`,
  `BackendError`;
- attention: `attention`, `merge_attention`, `additive_attention`, `varlen_attention`,
  `pack_padded`, `unpack_padded`, `attention_with_kvcache`, `PagedKVCache`;
- recurrent: `lstm_cell`, `lstm`, `gru_cell`, `gru`, `rnn_cell`, `rnn`;
- positional: `sinusoidal_table`, `add_sinusoidal`, `embed_with_positions`, `apply_rotary`;
- modules: `fastattn.nn`, `swap_modules`, `restore_modules`, `swap_summary`;
- the build: `build_info`.
"""

from __future__ import annotations

import torch  # noqa: F401  (must load before fastattn._C)

from . import _compile_cache, _native
from ._backend import BackendError, available_backends, last_backend, set_backend, use_backend
from .ops.additive_attention import additive_attention
from .ops.attention import attention, merge_attention
from .ops.attention_with_kvcache import attention_with_kvcache
from .ops.gru import gru, gru_cell
from .ops.lstm import lstm, lstm_cell
from .ops.positional import add_sinusoidal, apply_rotary, embed_with_positions, sinusoidal_table
from .ops.rnn import rnn, rnn_cell
from .ops.varlen_attention import pack_padded, unpack_padded, varlen_attention

__version__ = "0.1.0"

# Importing the ops above registered every backend's kernels as torch ops (the Triton ones
# where triton imports; otherwise available_backends() says why the triton backend is missing).
from . import nn
from .nn.paged_kv_cache import PagedKVCache
from .swap import restore_modules, swap_modules, swap_summary

# torch.compile caches must miss when fastattn changes (see _compile_cache).
_compile_cache.tag_compile_caches()

__all__ = [
    "BackendError",
    "available_backends",
    "use_backend",
    "set_backend",
    "last_backend",
    "attention",
    "merge_attention",
    "additive_attention",
    "varlen_attention",
    "pack_padded",
    "unpack_padded",
    "attention_with_kvcache",
    "PagedKVCache",
    "lstm_cell",
    "lstm",
    "gru_cell",
    "gru",
    "rnn_cell",
    "rnn",
    "sinusoidal_table",
    "add_sinusoidal",
    "embed_with_positions",
    "apply_rotary",
    "nn",
    "build_info",
    "swap_modules",
    "restore_modules",
    "swap_summary",
]


def build_info() -> dict:
    """How the native extension `fastattn._C` was built.

    Returns:
        A dict with the keys cuda, cuda_archs, cuda_home, cuda_version, torch_version (the torch
        whose headers built it), abi ("stable": libtorch's stable ABI, docs/design/stable_abi.md),
        torch_target (the oldest torch it runs under), python_abi ("abi3 (CPython >= 3.10)": one
        object for every such Python), cpu_isa, cpu_amx (whether bfloat16 attention runs its tile
        products on AMX), debug_checks and cuda_library ("loaded" or why the CUDA kernels' library
        is not, e.g. "not loaded: torch has no CUDA"); or `{"error": ...}` when the extension
        failed to import.
    """
    if _native.C is None:
        return {"error": _native.IMPORT_ERROR}
    info = dict(_native.C.build_info())
    info["cuda_library"] = _native.CUDA_STATUS  # "loaded" or why the CUDA kernels are not
    return info
