"""An offline corpus of real English: the documentation of the installed Python standard library.

Two parts, both read from source files with `ast` so that no module is imported (some stdlib modules act on
import): every docstring, and the topics of the language reference that `pydoc` ships in
`pydoc_data/topics.py`. One docstring or topic is one document (about 2 MB of text in all). The text
depends on the Python version, which therefore feeds the fingerprint of the data cache.
"""

from __future__ import annotations

import ast
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# Folders of the standard library that hold tests, vendored code or little prose.
_SKIP_DIRS = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "lib2to3",
    "turtledemo",
}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    root = stdlib_dir()
    files = [p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files)


def _docstrings(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield doc


def _pydoc_topics(tree: ast.AST) -> Iterator[str]:
    """The values of the `topics = {...}` literal in pydoc_data/topics.py."""
    for node in ast.walk(tree):
        is_topics = isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
        if is_topics and any(isinstance(t, ast.Name) and t.id == "topics" for t in node.targets):
            for value in node.value.values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    yield value.value


def iter_stdlib_docs() -> Iterator[dict[str, str]]:
    """Yield {"text", "source"} for every docstring and reference topic of the stdlib, in a fixed order."""
    root = stdlib_dir()
    for path in stdlib_files():
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, UnicodeDecodeError):  # a few files are templates or other encodings
            continue
        source = str(path.relative_to(root))
        texts = _pydoc_topics(tree) if source == "pydoc_data/topics.py" else _docstrings(tree)
        for text in texts:
            yield {"text": text, "source": source}


def fingerprint() -> str:
    """What the embedded corpus depends on: the Python version that supplies the docstrings."""
    return f"python-stdlib-docs:{sys.version.split()[0]}:{sys.implementation.name}"
