"""The layer rule of fastattn's Python code, checked from the source (ast, nothing imported):

    module (nn/) -> op (ops/) -> backends (triton/, reference/, native ops via torch.ops)
        -> contracts (contracts/: per-op output layouts, fakes, backward formulas)

A layer imports only the layers below it (and its own package); plumbing modules sit where
their users need them (_backend: backend choice, for ops and nn; _native: the compiled
extension; _debug: output poisoning, for kernels). Every import statement counts, also those
inside functions, so a "lazy" upward import fails here too.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

# The package that the tests import: the checkout's, or the installed one where only tests/ is
# copied (the CI's GPU-machine check), so the rule is never checked against nothing.
PACKAGE = Path(importlib.util.find_spec("fastattn").origin).resolve().parent

# Package (or module) -> the fastattn packages and modules it may import. A module not listed
# here (fastattn/__init__.py, swap.py, integrations/, __main__.py: the top) may import anything.
ALLOWED = {
    "fastattn.contracts": {"fastattn.contracts"},
    "fastattn.reference": {"fastattn.reference", "fastattn.contracts"},
    "fastattn.triton": {"fastattn.triton", "fastattn.contracts", "fastattn._debug"},
    # the torch backend: torch's own kernels, beside the kernel layers
    "fastattn.aten": {"fastattn.aten", "fastattn.contracts"},
    "fastattn.ops": {
        "fastattn.ops",
        "fastattn.contracts",
        "fastattn.reference",
        "fastattn.triton",
        "fastattn.aten",
        "fastattn._backend",
        "fastattn.speed_table",
        "fastattn._native",
        "fastattn._debug",
    },
    "fastattn.nn": {"fastattn.nn", "fastattn.ops", "fastattn.distributed", "fastattn._backend"},
    # context parallelism: modules-level code built on the ops and torch.distributed
    "fastattn.distributed": {"fastattn.distributed", "fastattn.ops", "fastattn._backend"},
    "fastattn._backend": {"fastattn._native", "fastattn.speed_table"},
    # the measured tables and their lookup, read by the automatic choice (_backend)
    "fastattn.speed_table": {"fastattn._native", "fastattn._backend", "fastattn.speed_tables"},
    "fastattn.speed_tables": set(),
    "fastattn._native": {"fastattn._C"},
    "fastattn._debug": {"fastattn._native"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) of every fastattn import in the file."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    return _imports_in(path.read_text(), package)


def _imports_in(source: str, package: str) -> list[tuple[int, str, list[str]]]:
    """_imports of `source`, a module of `package` (relative imports resolve against it)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "fastattn":
                    found.append((node.lineno, alias.name, []))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "fastattn":
                continue
            names = [alias.name for alias in node.names]
            if node.module is None or target in (
                "fastattn",
                "fastattn.ops",
                "fastattn.triton",
                "fastattn.reference",
                "fastattn.contracts",
                "fastattn.nn",
            ):
                # `from . import x` / `from fastattn import x`: x may itself be a module
                for alias in names:
                    found.append((node.lineno, f"{target}.{alias}", [alias]))
            else:
                found.append((node.lineno, target, names))
    return found


def _layer(module: str) -> str | None:
    for prefix in sorted(ALLOWED, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return prefix
    return None


def _allowed(layer: str, target: str) -> bool:
    if target in ("fastattn", "fastattn.__future__"):
        return False
    return any(target == ok or target.startswith(ok + ".") for ok in ALLOWED[layer]) or (
        # `from . import name` inside a package that holds `name` as an attribute, not a module
        target.rsplit(".", 1)[0] in ALLOWED[layer]
        and not (PACKAGE.parent / target.replace(".", "/")).with_suffix(".py").exists()
        and not (PACKAGE.parent / target.replace(".", "/")).is_dir()
    )


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_imports_follow_the_layers(path):
    module = _module_name(path)
    layer = _layer(module)
    if layer is None:
        pytest.skip(f"{module} is at the top: it may import every layer")
    wrong = [
        f"line {line}: {target}"
        for line, target, _ in _imports(path)
        if not _allowed(layer, target)
    ]
    assert not wrong, (
        f"{module} ({layer} layer) may import only "
        f"{sorted(ALLOWED[layer])}, but imports:\n" + "\n".join(wrong)
    )


def test_modules_use_public_ops_only():
    """fastattn/nn imports public names from public op modules: no ops._common, no _name."""
    wrong = []
    for path in sorted((PACKAGE / "nn").rglob("*.py")):
        for line, target, names in _imports(path):
            if not target.startswith("fastattn.ops"):
                continue
            private = [n for n in names if n.startswith("_")]
            if any(part.startswith("_") for part in target.split(".")) or private:
                wrong.append(f"{path.name} line {line}: {target} {private}")
    assert not wrong, "fastattn/nn must use public ops only:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "source",
    [
        "from ..ops.attention import attention\n",
        "import fastattn.ops.lstm\n",
        "def launch():\n    from ..nn import LSTM\n",
        "from .. import ops\n",
        "from ..reference.attention import scores\n",
    ],
    ids=["relative", "absolute", "inside-a-function", "package", "sibling-backend"],
)
def test_the_rule_catches_an_upward_import(source):
    """The checker itself: a Triton kernel module importing the op layer (or the modules, or
    the reference backend), relatively or absolutely, at the top or inside a function."""
    targets = [t for _, t, _ in _imports_in(source, "fastattn.triton")]
    assert targets and any(not _allowed("fastattn.triton", t) for t in targets), targets


def test_the_rule_accepts_the_contract_and_shared_helpers():
    source = (
        "from ..contracts.attention import output_like\n"
        "from . import finish, on_device\nfrom ._common import exp\n"
    )
    targets = [t for _, t, _ in _imports_in(source, "fastattn.triton")]
    assert all(_allowed("fastattn.triton", t) for t in targets), targets
