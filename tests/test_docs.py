"""The documentation's Python examples run as written, and show what their prose says.

Every ```python block of README.md and of the pages under docs/ is executed. The blocks assert
what the text around them documents (shapes, values against torch, errors), so a block whose
example stopped doing what the page says fails here, not only one that raises. A page's blocks
run in order in one namespace, as a reader runs them: a block may use names an earlier block of
the same page defined (a failing earlier block fails the later blocks' tests too, naming it).
They run on CPU tensors, small enough to keep this file fast.

A block that cannot run here (it needs a GPU, or several processes under torchrun) starts with
the visible comment `# not run by the tests: <why>`; its test is skipped with that reason.

Also checked: the README's relative links and images point at files that exist (Sphinx checks
the pages' own links, `make docs`), and no page cites a file outside the repository or an issue
number a reader cannot look up.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SKIP_MARKER = "# not run by the tests:"

pytestmark = pytest.mark.usefixtures("one_thread")


def python_blocks(path: Path) -> list[tuple[int, str, str]]:
    """(first code line number, section heading, code) of every ```python block of a page."""
    blocks, section, code, start = [], "top", None, 0
    for number, line in enumerate(path.read_text().splitlines(), start=1):
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


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:32]


BLOCKS = [(page, *block) for page in PAGES for block in python_blocks(page)]


def run_block(namespace: dict, page: Path, start: int, section: str, code: str, what: str):
    """Runs one block; a failure (an exception or a failed assert) fails the test, naming the
    page and line. what: how the message names the block (its own, or an earlier one's)."""
    try:
        # Pad so that tracebacks show the page's own line numbers.
        exec(compile("\n" * (start - 1) + code, str(page), "exec"), namespace)
    except Exception as exc:
        lines = [
            f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(page)
        ]
        where = f"the block at line {start}"
        if lines:  # a bare assert has no message: quote the line
            text = page.read_text().splitlines()[lines[-1] - 1].strip()
            where = f"line {lines[-1]} ({text})"
        pytest.fail(
            f"{what} block of {_name(page)} at line {start} ({section}) fails: {where}: "
            f"{type(exc).__name__}: {exc}"
        )


def skip_reason(code: str) -> str | None:
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    return first[len(SKIP_MARKER) :].strip() if first.startswith(SKIP_MARKER) else None


def test_pages_have_python_examples():
    pages = {page for page, *_ in BLOCKS}
    assert ROOT / "README.md" in pages, "README.md has no ```python block"
    assert any(page.parent.name == "guides" for page in pages), "no guide has a ```python block"


@pytest.mark.parametrize(
    "index",
    range(len(BLOCKS)),
    ids=[f"{_name(p)}:{s}-{_slug(sec)}" for p, s, sec, _ in BLOCKS],
)
def test_docs_block_runs(index):
    page, start, section, code = BLOCKS[index]
    reason = skip_reason(code)
    if reason is not None:
        pytest.skip(f"{_name(page)} line {start}: {reason}")
    namespace: dict = {"__name__": "docs_example"}
    for earlier_page, s, sec, c in BLOCKS[:index]:  # earlier blocks of the page define names
        if earlier_page == page and skip_reason(c) is None:
            run_block(namespace, page, s, sec, c, "an earlier")
    run_block(namespace, page, start, section, code, "the")


def test_readme_links_exist():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert targets and not missing, f"README.md links to missing files: {missing}"


def test_readme_install_section():
    """.ci/readme_install.sh runs the first bash block of this section verbatim."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Install with your own torch\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    assert "pip install --no-build-isolation ." in block


# A path under a folder outside the repository (the project's shared notes), or an issue cited
# by number: neither can be followed by a reader of the repository.
OUTSIDE = re.compile(r"(?<![\w/.])\.{0,2}/?shared/[A-Z_]+\.md|\b[Ii]ssue \d+|\bissues? #\d+")


def test_no_references_a_reader_cannot_follow():
    files = [
        *PAGES,
        *(ROOT / "tests").glob("*.py"),
        *(ROOT / "benchmarks").glob("*.py"),
        *(ROOT / "examples").glob("*.py"),
    ]
    found = []
    for path in files:
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if OUTSIDE.search(line):
                found.append(f"{_name(path)}:{number}: {line.strip()}")
    assert not found, "references a reader cannot follow:\n" + "\n".join(found)
