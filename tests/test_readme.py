"""The README's Python examples run as written.

Every ```python block of README.md is executed. Blocks may use names defined by earlier blocks
(they are run first, in order, in the same namespace) and the input tensors the prose
describes, which PRELUDE supplies: q, k, v, x, x_lbd, tokens, emb_weight, learned_table, cos,
sin, pos, pad, out1/lse1, out2/lse2. A block's traceback points at its README line numbers.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"

pytestmark = pytest.mark.usefixtures("one_thread")

PRELUDE = """
import torch
import fastattn

torch.manual_seed(0)
B, H, L, D = 3, 2, 16, 64
x = torch.randn(B, L, D)                               # (B, L, D) activations
x_lbd = torch.randn(L, B, D)                           # sequence-first activations
tokens = torch.randint(1, 50, (B, L))                  # token ids
emb_weight = torch.randn(50, D, requires_grad=True)    # embedding table
learned_table = torch.randn(32, D, requires_grad=True) # learned positions (max_len, D)
q, k, v = (torch.randn(B, H, L, D) for _ in range(3))  # (B, H, L, D)
cos, sin = torch.randn(32, 32).cos(), torch.randn(32, 32).sin()  # (max_pos, rotary_dim / 2)
pos = torch.randint(0, 32, (B, L))                     # position ids
pad = torch.rand(B, L) > 0.7                           # (B, Lk) True = padding
pad[:, 0] = False
out1, lse1 = fastattn.attention(q, k[:, :, :8], v[:, :, :8], return_lse=True)
out2, lse2 = fastattn.attention(q, k[:, :, 8:], v[:, :, 8:], return_lse=True)
"""


def python_blocks() -> list[tuple[int, str, str]]:
    """(first code line number, section heading, code) of every ```python block."""
    blocks, section, code, start = [], "top", None, 0
    for number, line in enumerate(README.read_text().splitlines(), start=1):
        if code is None:
            if re.match(r"^#{1,6} ", line):
                section = line.lstrip("#").strip()
            elif line.strip().startswith("```python"):
                code, start = [], number + 1
        elif line.strip().startswith("```"):
            blocks.append((start, section, "\n".join(code)))
            code = None
        else:
            code.append(line)
    return blocks


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40]


BLOCKS = python_blocks()


def run_block(namespace: dict, start: int, code: str) -> None:
    # Pad so that tracebacks show README.md's own line numbers.
    exec(compile("\n" * (start - 1) + code, str(README), "exec"), namespace)


def test_readme_has_python_examples():
    assert BLOCKS, "README.md has no ```python block"


@pytest.mark.parametrize(
    "index", range(len(BLOCKS)), ids=[f"line{s}-{_slug(sec)}" for s, sec, _ in BLOCKS]
)
def test_readme_block_runs(index):
    namespace: dict = {"__name__": "readme"}
    exec(PRELUDE, namespace)
    for start, _, code in BLOCKS[:index]:
        try:  # earlier blocks define names; their own failures are their own tests'
            run_block(namespace, start, code)
        except Exception:
            pass
    start, section, code = BLOCKS[index]
    try:
        run_block(namespace, start, code)
    except Exception as exc:
        lines = [
            f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(README)
        ]
        where = f"README.md line {lines[-1]}" if lines else f"the block at line {start}"
        pytest.fail(
            f"README.md block at line {start} ({section}) does not run: {where}: "
            f"{type(exc).__name__}: {exc}"
        )
