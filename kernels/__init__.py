"""Triton kernels, each beside a pure-PyTorch reference.

Installed as `cramming.kernels` (see pyproject.toml): import them as `from cramming.kernels import ...`,
never as a bare `kernels`, which is also the name of an unrelated PyPI distribution.
"""
