"""The commit style, checked on the message of each commit (pre-commit's commit-msg stage).

    python tools/check_commit_msg.py MESSAGE_FILE

A message is a subject line of at most 72 characters that says what changed, then, when there
is more to say (why), a blank line and the body. Lines git drops (those starting with "#",
and everything below the scissors line of `git commit -v`) are not part of the message.
Exits 1 with the rule that failed, 0 when the message follows the style.
"""

from __future__ import annotations

import sys
from pathlib import Path

MAX_SUBJECT = 72
SCISSORS = "# ------------------------ >8 ------------------------"


def message_lines(text: str) -> list[str]:
    """The lines git keeps: comment lines and what follows the scissors line removed, trailing
    blank lines dropped."""
    lines = []
    for line in text.splitlines():
        if line.startswith(SCISSORS):
            break
        if not line.startswith("#"):
            lines.append(line.rstrip())
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def problems(text: str) -> list[str]:
    """What in the message breaks the style; empty when it follows it."""
    lines = message_lines(text)
    if not lines:
        return ["the message is empty"]
    found = []
    subject = lines[0]
    if len(subject) > MAX_SUBJECT:
        found.append(
            f"the subject is {len(subject)} characters, more than {MAX_SUBJECT}: say what "
            "changed in the subject and move the details to the body"
        )
    if len(lines) > 1 and lines[1]:
        found.append("the subject must be followed by a blank line before the body")
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    found = problems(Path(argv[1]).read_text(encoding="utf-8"))
    for problem in found:
        print(f"commit message: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
