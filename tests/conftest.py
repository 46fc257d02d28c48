"""Shared fixtures: every test is seeded; paths to the shared real data."""

from __future__ import annotations

from pathlib import Path

import pytest

from cramming.utils import seed_everything

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
WIKI_DIR = SHARED_DATA / "wikipedia-en-2015"
GLUE_DIR = SHARED_DATA / "glue"


@pytest.fixture(autouse=True)
def _seed():
    seed_everything(0)


@pytest.fixture
def wiki_shard() -> Path:
    shard = WIKI_DIR / "train-00000-of-00012.jsonl.gz"
    if not shard.exists():
        pytest.skip(f"shared Wikipedia data not found at {WIKI_DIR}")
    return shard
