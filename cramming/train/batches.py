"""An endless, resumable stream of training micro-batches.

Row r of the stream is a pure function of r: the stored order in the first epoch (the data pipeline may
have put a curriculum there), a seeded permutation in each later one. So a resumed run continues at the
exact row where the saved one stopped, even with another micro-batch size, and loader workers need no
shared state.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

if TYPE_CHECKING:  # only annotations: the stream also takes any table with the same interface (benchmarks)
    import datasets


@dataclass
class Progress:
    """Where the run stands in the stream: saved in the resumable state. (The updates are counted once, by
    the train step: cramming.optim.step.StepStats.)"""

    # training rows of completed updates, applied or skipped: the data position a resumed run starts from
    rows: int = 0
    microbatches: int = 0


def first_stream_row(start: int, i: int, microbatch_size: int, rank: int = 0, world_size: int = 1) -> int:
    """Stream position of the first row of this rank's micro-batch i of a stream that starts at `start`."""
    return start + (i * world_size + rank) * microbatch_size


class RowStream(Dataset):
    """Item i: the micro-batch of rows [start + i * microbatch_size, start + (i + 1) * microbatch_size).

    Sharded over `world_size` ranks, item i of rank r is slice r of the global micro-batch i of
    world_size * microbatch_size rows: the ranks never overlap and together see what one process sees."""

    def __init__(
        self,
        rows: datasets.Dataset,
        microbatch_size: int,
        seed: int,
        start: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.rows = rows.with_format("numpy", columns=["input_ids"])
        self.num_rows = len(rows)
        self.microbatch_size = microbatch_size
        self.seed = seed
        self.start = start
        self.rank, self.world_size = rank, world_size
        self._epoch, self._order = 0, None  # cache of the current epoch's permutation

    def row_indices(self, stream_rows: np.ndarray) -> np.ndarray:
        """Dataset indices of stream positions."""
        epochs, within = np.divmod(stream_rows, self.num_rows)
        out = within.copy()
        for epoch in np.unique(epochs):
            if epoch == 0:
                continue
            sel = epochs == epoch
            out[sel] = self._permutation(int(epoch))[within[sel]]
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._order is None or self._epoch != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.num_rows, generator=generator).numpy()
        return self._order

    def __len__(self) -> int:  # the stream is endless; DataLoader only needs this for its own bookkeeping
        return 2**62

    def __getitem__(self, i: int) -> torch.Tensor:
        first = first_stream_row(self.start, i, self.microbatch_size, self.rank, self.world_size)
        indices = self.row_indices(np.arange(first, first + self.microbatch_size))
        ids = self.rows[indices]["input_ids"]  # (microbatch, seq), uint16 or int32 on disk
        return torch.from_numpy(np.asarray(ids, dtype=np.int64))


def microbatches(
    rows: datasets.Dataset,
    microbatch_size: int,
    seed: int,
    start: int,
    num_workers: int,
    pin_memory: bool,
    rank: int = 0,
    world_size: int = 1,
) -> DataLoader:
    """Endless DataLoader of (microbatch, seq) int64 tensors starting at stream row `start` (this rank's
    share of each global micro-batch when sharded)."""
    stream = RowStream(rows, microbatch_size, seed, start, rank, world_size)
    return DataLoader(
        stream,
        batch_size=None,  # each item already is a micro-batch
        sampler=itertools.count(),
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        prefetch_factor=4 if num_workers > 0 else None,
        # its own generator: iterating a DataLoader draws a worker base seed, which from the global RNG would
        # shift the dropout stream by when the loader starts (a resumed run starts it after the restore)
        generator=torch.Generator().manual_seed(seed),
    )


def numbered(
    loader: Iterable[torch.Tensor], start: int, microbatch_size: int, rank: int = 0, world_size: int = 1
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(stream positions (microbatch,), input_ids (microbatch, seq)) of each micro-batch of `loader`: the
    positions key each row's MLM mask (cramming.train.mlm)."""
    for i, input_ids in enumerate(loader):
        first = first_stream_row(start, i, microbatch_size, rank, world_size)
        yield torch.arange(first, first + input_ids.shape[0]), input_ids
