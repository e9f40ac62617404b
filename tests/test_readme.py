"""The README's Python examples run as written, and show what their prose says.

Every ```python block of README.md is executed. The blocks assert what the text around them
documents (shapes, values against torch, errors), so a block whose example stopped doing what
the README says fails here, not only one that raises. Blocks may use names defined by earlier
blocks (they are run first, in order, in the same namespace: a failing earlier block fails the
later blocks' tests too, naming it) and the input tensors the prose describes, which PRELUDE
supplies: B, H, L, D, q, k, v, x, x_lbd, tokens, emb_weight, learned_table, cos, sin, pos, pad.
A block's traceback points at its README line numbers.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
README_LINES = README.read_text().splitlines()

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
"""


def python_blocks() -> list[tuple[int, str, str]]:
    """(first code line number, section heading, code) of every ```python block."""
    blocks, section, code, start = [], "top", None, 0
    for number, line in enumerate(README_LINES, start=1):
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


def run_block(namespace: dict, start: int, section: str, code: str, what: str) -> None:
    """Runs one block; a failure (an exception or a failed assert) fails the test, naming the
    README line. what: how the message names the block (its own, or an earlier one's)."""
    try:
        # Pad so that tracebacks show README.md's own line numbers.
        exec(compile("\n" * (start - 1) + code, str(README), "exec"), namespace)
    except Exception as exc:
        lines = [
            f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(README)
        ]
        where = f"the block at line {start}"
        if lines:  # a bare assert has no message: quote the line
            text = README_LINES[lines[-1] - 1].strip()
            where = f"README.md line {lines[-1]} ({text})"
        pytest.fail(
            f"{what} README.md block at line {start} ({section}) fails: {where}: "
            f"{type(exc).__name__}: {exc}"
        )


def test_readme_has_python_examples():
    assert BLOCKS, "README.md has no ```python block"


@pytest.mark.parametrize(
    "index", range(len(BLOCKS)), ids=[f"line{s}-{_slug(sec)}" for s, sec, _ in BLOCKS]
)
def test_readme_block_runs(index):
    namespace: dict = {"__name__": "readme"}
    exec(PRELUDE, namespace)
    for start, section, code in BLOCKS[:index]:  # earlier blocks define names a reader has
        run_block(namespace, start, section, code, "an earlier")
    start, section, code = BLOCKS[index]
    run_block(namespace, start, section, code, "the")
