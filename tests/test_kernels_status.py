"""`triton_status()`: whether a Triton kernel can launch here, and a reason that names the fix."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cramming.kernels import triton_status


def test_interpreter_counts_as_launchable(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ok, why = triton_status()
    if importlib.util.find_spec("triton") is None:
        assert not ok and "not installed" in why
    else:
        assert ok and "interpreter" in why


def test_cpu_without_interpreter_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, why = triton_status()
    assert not ok
    assert "not installed" in why or "TRITON_INTERPRET=1" in why


def test_missing_triton_says_so(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a)
    )
    ok, why = triton_status()
    assert not ok and "pip install triton" in why


# Python run from the repository root puts the root first on sys.path, where our kernels/ folder would
# answer a bare `import kernels`: the name of the PyPI distribution transformers imports. These run Python
# there, as `python pretrain.py` and `python -m pytest` do.
ROOT = Path(__file__).resolve().parents[1]


def run_at_root(code: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *flags, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_a_bare_import_kernels_at_the_root_finds_the_package_of_that_name_elsewhere(tmp_path):
    other = tmp_path / "kernels"
    other.mkdir()
    (other / "__init__.py").write_text("WHOSE = 'theirs'\n")
    (other / "sub.py").write_text("WHOSE = 'their submodule'\n")
    done = run_at_root(
        f"import sys; sys.path.insert(1, {str(tmp_path)!r})\n"
        "import kernels, kernels.sub, cramming.kernels\n"
        "print(kernels.WHOSE, '|', kernels.sub.WHOSE, '|', callable(cramming.kernels.triton_status))\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("|") == ["theirs ", " their submodule ", " True\n"]


def test_a_bare_import_kernels_at_the_root_is_an_empty_package_when_no_such_package_is_installed():
    # -S: no site-packages, so only the repository root could answer. A probe that found the name and
    # imports it must read it as not installed (no file, no version), and none of our modules is under it.
    done = run_at_root(
        "import importlib.util, kernels\n"
        "assert importlib.util.find_spec('kernels') is not None\n"
        "print(kernels.__file__, getattr(kernels, '__version__', 'N/A'), list(kernels.__path__))\n"
        "for name in ('kernels.attention', 'kernels.layernorm'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError:\n"
        "        print('no', name)\n"
        "from kernels import triton_status\n",
        "-S",
    )
    assert done.stdout.splitlines() == ["None N/A []", "no kernels.attention", "no kernels.layernorm"]
    assert "ImportError: cannot import name 'triton_status' from 'kernels'" in done.stderr


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
@pytest.mark.slow
def test_transformers_imports_its_models_from_the_root():
    # transformers >= 5 imports the `kernels` distribution (when installed) as it loads modeling_utils
    done = run_at_root("from transformers import PreTrainedModel; print(PreTrainedModel.__name__)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "PreTrainedModel"
