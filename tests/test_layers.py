"""Layers point down: data → model → optim → train → eval. Importing every module of a layer, in a fresh
process, loads no module of a layer above it (an import cycle or an upward import fails here)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import cramming

LAYERS = ["data", "model", "optim", "train", "eval"]


def modules_of(layer: str) -> list[str]:
    package = f"cramming.{layer}"
    path = [str(p) for p in cramming.__path__]
    found = [m.name for m in pkgutil.iter_modules([f"{path[0]}/{layer}"], prefix=f"{package}.")]
    return [package, *found]


@pytest.mark.parametrize("layer", LAYERS[:-1])
def test_a_layer_imports_nothing_above_it(layer):
    above = [f"cramming.{name}" for name in LAYERS[LAYERS.index(layer) + 1 :]] + ["cramming.config"]
    code = (
        "import importlib, sys\n"
        f"for name in {modules_of(layer)!r}:\n"
        "    importlib.import_module(name)\n"
        f"bad = sorted(m for m in sys.modules if any(m == a or m.startswith(a + '.') for a in {above!r}))\n"
        "print('\\n'.join(bad))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "", f"cramming.{layer} loads modules of a higher layer:\n{done.stdout}"
