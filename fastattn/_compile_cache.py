"""fastattn's fingerprint in torch.compile's cache keys.

AOTAutograd's cache keys a compiled graph on the graph dynamo traced, which names a fastattn op
(`torch.ops.fastattn.attention_forward`) but not the autograd formula or the backward op behind
it. After fastattn changes (an upgrade, a rebuild with another schema) a warm cache would hand
back a backward compiled against the old code: an argument-count error at best, a wrong
gradient at worst. torch.compiler.config.cache_key_tag is torch's documented way to add to
every cache key; fastattn appends a fingerprint of its own sources and native library, so a
changed fastattn misses the cache and an unchanged one still hits it.
"""

from __future__ import annotations

import hashlib
import os

import torch

_TAG_PREFIX = "fastattn-"


def package_fingerprint() -> str:
    """A short hash of fastattn's Python sources and native library (path, size, mtime): it
    changes whenever either does. Costs one directory walk (about a millisecond)."""
    root = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = sorted(d for d in subdirectories if d != "__pycache__")
        for name in sorted(files):
            if not (name.endswith(".py") or name.endswith(".so") or name.endswith(".pyd")):
                continue
            path = os.path.join(directory, name)
            stat = os.stat(path)
            relative = os.path.relpath(path, root)
            digest.update(f"{relative}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:16]


def tag_compile_caches() -> None:
    """Appends fastattn's fingerprint to torch.compiler.config.cache_key_tag (once; a user's
    own tag is kept in front of it)."""
    config = getattr(getattr(torch, "compiler", None), "config", None)
    if config is None or not hasattr(config, "cache_key_tag"):
        return
    current = config.cache_key_tag or ""
    if _TAG_PREFIX in current:
        return
    tag = _TAG_PREFIX + package_fingerprint()
    config.cache_key_tag = f"{current}|{tag}" if current else tag
