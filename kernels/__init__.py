"""Triton kernels, each beside a pure-PyTorch reference.

Installed as `cramming.kernels` (see pyproject.toml): import them as `from cramming.kernels import ...`,
never as a bare `kernels`, which is also the name of an unrelated PyPI distribution.

The kernel modules (`attention`, `layernorm`) import triton; this file does not, so that the package
imports on a machine without triton and `triton_status()` can say why the kernels are unavailable.

Python run from the repository root (`python pretrain.py`, `python eval.py`, `python -m pytest`) puts the
root first on `sys.path`, where this folder would answer a bare `import kernels`, the name of the PyPI
distribution that transformers imports (`from kernels import ...`). Imported under that name, this file
loads the distribution in its place, or an empty package when none is installed (see the end of the file).

No packaging avoids that hand-over. The folder shadows the distribution because this `__init__.py` makes it
a regular package, and the first regular package on sys.path wins. Without the file the folder would be a
namespace portion, which loses to a regular `kernels` anywhere on the path (PEP 420: a namespace package is
made only when no sys.path entry holds a regular package or module of that name). But then the editable
install (`pip install -e .`, setuptools 84) cannot import `cramming.kernels`: its finder maps that name to
this folder only through an `__init__.py` (or a `kernels.py` beside the folder), and its namespace hook
serves top-level names only; a wheel would install it, as a namespace subpackage. The folder's name is the
design's, and the root on sys.path is Python's doing (`python pretrain.py`, `python -m pytest`).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def triton_status(device_type: str | None = None) -> tuple[bool, str]:
    """Whether a Triton kernel can launch here (on `device_type`, e.g. "cpu", when given), and why not.

    A kernel launches on a CUDA device, or on CPU in the Triton interpreter (`TRITON_INTERPRET=1`, read by
    triton when a kernel module is first imported: set it before that). The model uses this to fall back
    to its PyTorch path with one warning, or to raise when asked to be strict.
    """
    if importlib.util.find_spec("triton") is None:
        return (
            False,
            "triton is not installed (pip install -e '.[kernels]', or pip install triton; it ships for Linux only)",
        )
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return True, "Triton interpreter (TRITON_INTERPRET=1): runs on CPU, slow, for tests only"
    import torch

    if device_type not in (None, "cuda"):
        return False, f"the model runs on {device_type}, and TRITON_INTERPRET=1 is not set"
    if torch.cuda.is_available():
        return True, f"CUDA device: {torch.cuda.get_device_name()}"
    return False, "no CUDA device, and TRITON_INTERPRET=1 is not set (set it before importing the kernels)"


def _hand_the_bare_name_over() -> None:
    """Put the `kernels` found on sys.path outside this repository into sys.modules["kernels"].

    The import system returns whatever sys.modules holds for a name once its module has run, so the
    importer gets the distribution, never this folder under a second name. With none installed it gets an
    empty package with no file and no version, as this folder would read without this file (a namespace
    package): `from kernels import x` fails, and a probe that found the name and then imports it (as
    transformers' package check does when no distribution metadata exists) reads it as not installed.
    """
    root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is None:
        spec = importlib.machinery.ModuleSpec("kernels", None, is_package=True)
        spec.submodule_search_locations = []  # nothing under it either: our modules are cramming.kernels.*
    module = importlib.util.module_from_spec(spec)  # gives the empty package a (do-nothing) loader
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _hand_the_bare_name_over()
