"""tools/check_commit_msg.py, the commit-msg hook: a subject of at most 72 characters, then a
blank line before the body."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "check_commit_msg.py"


def run(tmp_path: Path, message: str) -> subprocess.CompletedProcess:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message, encoding="utf-8")
    return subprocess.run(
        [sys.executable, str(TOOL), str(path)], capture_output=True, text=True, check=False
    )


@pytest.mark.parametrize(
    "message",
    [
        "docs: a site built by make docs\n",
        "x" * 72 + "\n\nThe body may be as long as it needs:" + " words" * 40 + "\n",
        "subject\n\nbody\n# Please enter the commit message (git's comment)\n",
        "subject\n# a comment line git drops\n",
        "subject\n\n# ------------------------ >8 ------------------------\n" + "diff " * 40,
    ],
    ids=["subject-only", "72-and-long-body", "trailing-comment", "comment-second", "scissors"],
)
def test_accepts(tmp_path, message):
    result = run(tmp_path, message)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "message, rule",
    [
        ("x" * 73 + "\n", "73 characters, more than 72"),
        ("subject\nbody right below\n", "blank line"),
        ("\n# only comments\n", "empty"),
    ],
    ids=["subject-73", "no-blank-line", "empty"],
)
def test_refuses(tmp_path, message, rule):
    result = run(tmp_path, message)
    assert result.returncode == 1
    assert rule in result.stderr
