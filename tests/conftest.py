"""Shared fixtures: every test is seeded; paths to the shared real data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from cramming.utils import seed_everything

# No GPU: run Triton kernels in the interpreter (read when the first @triton.jit module is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
WIKI_DIR = SHARED_DATA / "wikipedia-en-2015"
GLUE_DIR = SHARED_DATA / "glue"


# The suite's models are tiny: synchronizing two intra-op threads costs more than it saves, and on a
# machine with other work running it costs up to 7x (measured: 20 ms vs 136 ms per tiny-model step).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    seed_everything(0)


@pytest.fixture
def wiki_shard() -> Path:
    shard = WIKI_DIR / "train-00000-of-00012.jsonl.gz"
    if not shard.exists():
        pytest.skip(f"shared Wikipedia data not found at {WIKI_DIR}")
    return shard


@pytest.fixture
def glue_dir() -> Path:
    if not GLUE_DIR.exists():
        pytest.skip(f"shared GLUE data not found at {GLUE_DIR}")
    return GLUE_DIR


def _wiki_texts(n: int) -> list[str]:
    import gzip
    import json

    shard = WIKI_DIR / "train-00000-of-00012.jsonl.gz"
    if not shard.exists():
        pytest.skip(f"shared Wikipedia data not found at {WIKI_DIR}")
    texts = []
    with gzip.open(shard, "rt", encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            if len(texts) == n:
                break
    return texts


@pytest.fixture(scope="session")
def wiki_texts() -> list[str]:
    """The first 120 real Wikipedia articles of the shared data, as plain strings."""
    return _wiki_texts(120)


@pytest.fixture
def data_config():
    """Build a validated DataConfig from conf/data/local.yaml plus dotted-key overrides."""
    from omegaconf import OmegaConf

    from cramming.data.config import DataConfig

    def make(files: str | Path, overrides: dict | None = None):
        cfg = OmegaConf.merge(
            OmegaConf.structured(DataConfig), OmegaConf.load(REPO / "conf" / "data" / "local.yaml")
        )
        cfg.sources.local.files = str(files)
        # small and fast unless a test says otherwise
        cfg.tokenizer.vocab_size = 1024
        cfg.seq_length = 64
        for key, value in (overrides or {}).items():
            OmegaConf.update(cfg, key, value, merge=False)
        return OmegaConf.to_object(cfg)

    return make
