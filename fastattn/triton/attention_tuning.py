"""Tile shapes of the Triton attention kernels (fastattn/triton/attention.py): the autotuning
tables for CUDA, the shared-memory pruner that keeps only the tiles a device can hold, and the
one tile shape used under the CPU interpreter. Kept apart from the kernels so that retuning
touches no kernel code.

Per head-dim class (the padded max(D, Dv)): <= 64, <= 128, > 128. Above 128 the tiles shrink
so that q (or k, v, dk, dv) tiles, the pipeline stages of the streamed tiles and the float32
accumulators fit an H100's shared memory (227 KB a block) and registers. A pruner drops the
configs whose tiles would not fit the device's shared memory for this call's dtype and head
dims (float32 doubles them); each list holds a config that fits a 99 KB card (sm_86/89/120),
and tests/triton_aot.py replays the pruning for 99, 163 and 227 KB. A config that still
fails to compile is skipped by the autotuner. The key is the head dims, the mask kind,
dropout and coarse length classes, so that new lengths do not trigger a tuning run each.
FASTATTN_TRITON_AUTOTUNE=0 uses the first config that fits instead of tuning (quicker test
runs on a GPU): each list starts with a config that compiles for sm_90 without spills in the
plain case and with at most a few hundred bytes of stack with a mask or dropout
(tests/triton_aot.py reports them; docs/design/triton_aot.md).
"""

from __future__ import annotations

import os

import torch
import triton

from . import device_shared_memory, tile_budget


def _config(block_m, block_n, warps, stages):
    return triton.Config(
        {"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages
    )


_FWD_CONFIGS = {
    64: [
        _config(64, 64, 4, 3),
        _config(128, 64, 4, 3),
        _config(128, 128, 8, 3),
        _config(128, 32, 4, 4),
        _config(64, 32, 4, 2),
    ],
    128: [
        _config(64, 64, 4, 3),
        _config(128, 64, 8, 3),
        _config(128, 32, 4, 3),
        _config(128, 128, 8, 2),
        _config(64, 32, 4, 2),
    ],
    256: [
        _config(64, 32, 4, 2),
        _config(64, 64, 4, 2),
        _config(128, 32, 8, 2),
        _config(32, 32, 4, 1),
    ],
}
_DKDV_CONFIGS = {
    64: [
        _config(64, 64, 4, 3),
        _config(32, 128, 4, 3),
        _config(64, 128, 8, 2),
        _config(32, 64, 4, 2),
    ],
    128: [
        _config(32, 128, 8, 2),
        _config(64, 64, 8, 2),
        _config(32, 64, 4, 2),
        _config(16, 64, 4, 2),
    ],
    256: [_config(16, 32, 4, 1), _config(32, 32, 4, 2), _config(32, 64, 8, 1)],
}
_DQ_CONFIGS = {
    64: [
        _config(128, 32, 4, 3),
        _config(64, 64, 4, 3),
        _config(128, 64, 8, 2),
        _config(64, 32, 4, 2),
    ],
    128: [
        _config(128, 32, 8, 2),
        _config(64, 32, 4, 2),
        _config(64, 64, 8, 2),
        _config(32, 32, 4, 2),
    ],
    256: [_config(32, 32, 4, 2), _config(64, 32, 8, 1), _config(32, 16, 4, 1)],
}
# float32 runs its dots with input_precision="ieee" (FMA units, not tensor cores) and keeps
# every tile in registers: the 16-bit tiles above would spill kilobytes per thread on sm_90
# (tests/triton_aot.py reports registers and stack). Small tiles instead.
_FWD_CONFIGS_FP32 = {
    64: [_config(32, 32, 4, 2), _config(64, 16, 4, 2), _config(64, 32, 4, 2)],
    128: [
        _config(32, 32, 4, 2),
        _config(64, 16, 4, 2),
        _config(32, 16, 4, 2),
        _config(64, 32, 8, 2),
        _config(16, 32, 4, 2),
    ],
    256: [
        _config(32, 16, 4, 1),
        _config(16, 16, 4, 1),
        _config(16, 32, 4, 1),
        _config(32, 32, 8, 1),
    ],
}
_DKDV_CONFIGS_FP32 = {
    64: [
        _config(16, 32, 4, 2),
        _config(32, 32, 4, 2),
        _config(16, 64, 4, 2),
        _config(32, 64, 8, 2),
    ],
    128: [
        _config(16, 32, 4, 2),
        _config(16, 16, 4, 2),
        _config(32, 32, 8, 2),
        _config(16, 64, 8, 2),
    ],
    256: [_config(16, 16, 4, 1), _config(16, 32, 8, 1), _config(16, 16, 8, 1)],
}
_DQ_CONFIGS_FP32 = {
    64: [
        _config(32, 16, 4, 2),
        _config(32, 32, 4, 2),
        _config(64, 16, 4, 2),
        _config(64, 32, 8, 2),
    ],
    128: [
        _config(16, 32, 4, 2),
        _config(32, 16, 4, 2),
        _config(16, 16, 4, 2),
        _config(32, 32, 8, 2),
    ],
    256: [_config(16, 16, 4, 1), _config(32, 16, 8, 1), _config(16, 32, 8, 1)],
}
_TUNE_KEY = ["BLOCK_D", "BLOCK_DV", "LQ_CLASS", "LK_CLASS", "MASK_KIND", "HAS_DROPOUT", "VARLEN"]


def tile_shared_bytes(
    kernel: str, block_m: int, block_n: int, stages: int, block_d: int, block_dv: int, itemsize: int
) -> int:
    """Shared memory that the tiles of one program take: the resident tile plus `stages`
    streamed tiles. The forward and dQ kernels keep a BLOCK_M tile of q (and dO) and stream
    BLOCK_N tiles of k and v; the dK/dV kernel keeps BLOCK_N keys and streams BLOCK_M tiles of
    q and dO."""
    stages = max(stages, 1)
    if kernel == "fwd":
        tiles = block_m * block_d + stages * block_n * (block_d + block_dv)
    elif kernel == "dq":
        tiles = block_m * (block_d + block_dv) + stages * block_n * (block_d + block_dv)
    else:
        tiles = block_n * (block_d + block_dv) + stages * block_m * (block_d + block_dv)
    return tiles * itemsize


def pruner(kernel: str):
    """early_config_prune: drop configs whose tiles exceed the shared memory of the call's
    device (tile_budget: the device's opt-in limit less Triton's scratch), so that an A100 or
    an sm_86/89/120 card only tries configs that fit. Every list holds small tiles that fit a
    99 KB card; on a smaller device the smallest config is kept while its tiles fit the whole
    limit, and the call is refused when not even they do."""

    def prune(configs, named_args, **kwargs):
        meta = {**named_args, **kwargs}
        d, dv = meta.get("BLOCK_D", 256), meta.get("BLOCK_DV", 256)
        q = meta.get("Q")
        itemsize = getattr(getattr(q, "dtype", None), "itemsize", 4)
        device = getattr(q, "device", torch.device("cuda"))

        def shared_bytes(c):
            return tile_shared_bytes(
                kernel, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages, d, dv, itemsize
            )

        fitting = [c for c in configs if shared_bytes(c) <= tile_budget(device)]
        if not fitting:
            smallest = min(configs, key=shared_bytes)
            limit = device_shared_memory(device)
            if shared_bytes(smallest) > limit:
                raise ValueError(
                    f"attention (triton): no {kernel} tile configuration fits the shared "
                    f"memory of {device} ({limit} bytes a block) with head dims padded to "
                    f"{d}/{dv} and {itemsize}-byte elements; the smallest needs "
                    f"{shared_bytes(smallest)} bytes"
                )
            fitting = [smallest]
        return fitting if _AUTOTUNE else fitting[:1]

    return prune


_AUTOTUNE = os.environ.get("FASTATTN_TRITON_AUTOTUNE", "1") != "0"


# kernel name -> (16-bit tables, float32 tables), per head-dim class
TABLES = {
    "fwd": (_FWD_CONFIGS, _FWD_CONFIGS_FP32),
    "dkdv": (_DKDV_CONFIGS, _DKDV_CONFIGS_FP32),
    "dq": (_DQ_CONFIGS, _DQ_CONFIGS_FP32),
}


# The autotuned copies tuned() made, by kernel name, for winners().
_TUNED: dict[str, dict] = {}


def tuned(kernel, name: str, reset_to_zero: list[str] | None = None) -> dict:
    """Autotuned copies of `kernel` ("fwd", "dkdv" or "dq": its tables and pruner), keyed by
    (float32?, head-dim class). reset_to_zero: arguments the kernel accumulates into (zeroed
    before every timed run and before the real one)."""
    configs, configs_fp32 = TABLES[name]
    copies = {
        (fp32, cls): triton.autotune(
            configs=cfgs,
            key=_TUNE_KEY,
            prune_configs_by={"early_config_prune": pruner(name)},
            reset_to_zero=reset_to_zero,
        )(kernel)
        for fp32, table in ((False, configs), (True, configs_fp32))
        for cls, cfgs in table.items()
    }
    _TUNED[name] = copies
    return copies


def winners() -> list[dict]:
    """The configs the autotuner chose in this process, one row per kernel, table (float32?,
    head-dim class) and tuning key (_TUNE_KEY's values, then the argument dtypes triton adds):
    what a GPU run reports so that the tables above can put each class's winners first."""
    rows = []
    for name, copies in _TUNED.items():
        for (fp32, cls), autotuner in copies.items():
            for key, config in getattr(autotuner, "cache", {}).items():
                rows.append(
                    {
                        "kernel": name,
                        "float32": fp32,
                        "head_class": cls,
                        "key": dict(zip(_TUNE_KEY, (str(v) for v in key))),
                        "key_rest": [str(v) for v in key[len(_TUNE_KEY) :]],
                        "config": {
                            **config.kwargs,
                            "num_warps": config.num_warps,
                            "num_stages": config.num_stages,
                        },
                    }
                )
    return rows


def head_class(block_d: int, block_dv: int) -> int:
    widest = max(block_d, block_dv)
    return 64 if widest <= 64 else 128 if widest <= 128 else 256


def length_class(length: int) -> int:
    """Coarse autotune bucket of a sequence length: 64, 256, 1024, 4096, 16384."""
    c = 64
    while c < length and c < 16384:
        c *= 4
    return c


def interpreter_block(length: int) -> int:
    # Under the interpreter every tile op is a numpy call: large tiles cost fewer calls, and
    # tiles beyond the length only waste work.
    return max(16, min(128, triton.next_power_of_2(max(length, 1))))
