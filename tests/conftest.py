"""Shared fixtures: every test is seeded; the real data, found through CRAMMING_DATA.

Tests that want real data ask `data_dir(...)` for it, in the folder the environment variable CRAMMING_DATA
names: `glue/<task>/train.tsv, dev.tsv, ...` (GLUE's original TSV layout, as `scripts/get_data.py glue`
writes it), `wikipedia-en-2015/train-000NN-of-00012.jsonl.gz` (the CPU study's shards), `blimp/` and
`checkpoints/`. Without it those tests skip, saying so; everything else runs on a fresh clone with nothing
beside it. CI sets it (.ci/run). `python scripts/get_data.py test-data --out data/test` makes the folder on a
machine with network (all but `checkpoints/cpu-study-tiny-30min`, whose pretraining command it prints).
"""

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
DATA_ENV = "CRAMMING_DATA"
WIKI_SHARD = ("wikipedia-en-2015", "train-00000-of-00012.jsonl.gz")


def data_dir(*parts: str) -> Path:
    """A path under the real-data folder that CRAMMING_DATA names; skips the calling test (or fixture) when
    the variable is unset or the path is not there."""
    root = os.environ.get(DATA_ENV)
    if not root:
        pytest.skip(
            f"{DATA_ENV} is not set: this test reads {Path(*parts)} from the folder it names; set it to run this"
        )
    path = Path(root).expanduser().resolve().joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{Path(*parts)} is not in {DATA_ENV}={root}")
    return path


# The suite's models are tiny: synchronizing two intra-op threads costs more than it saves, and on a
# machine with other work running it costs up to 7x (measured: 20 ms vs 136 ms per tiny-model step).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    seed_everything(0)


@pytest.fixture
def wiki_shard() -> Path:
    return data_dir(*WIKI_SHARD)


@pytest.fixture
def glue_dir() -> Path:
    return data_dir("glue")


def _wiki_texts(n: int) -> list[str]:
    import gzip
    import json

    shard = data_dir(*WIKI_SHARD)
    texts = []
    with gzip.open(shard, "rt", encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            if len(texts) == n:
                break
    return texts


@pytest.fixture(scope="session")
def wiki_texts() -> list[str]:
    """The first 120 real Wikipedia articles of the first shard, as plain strings."""
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
