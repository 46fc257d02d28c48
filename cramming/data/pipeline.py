"""The preprocessing pipeline and its cache.

    raw text -> normalize + drop empty and short texts -> exact dedup -> hold out validation documents
             -> train tokenizer (on a sample across sources) -> tokenize + drop "trash" (too many tokens
             per character)
             -> join documents with [SEP] and cut into rows of seq_length -> order -> cap -> save

The result (Arrow via `datasets`), the tokenizer and the resolved data config are saved together in
`{cache_root}/{name}-{hash}`, where the hash covers the resolved data config and the fingerprints of the
sources (for local files: a hash of their bytes, not their paths or times). A second run with the same config finds the folder and skips all of it. The folder is built under a
temporary name and renamed when complete, so an interrupted run never leaves a half-written cache behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from omegaconf import OmegaConf
from tokenizers import Tokenizer

from cramming.data.config import DataConfig
from cramming.data.ordering import ORDERINGS, SEGMENTS
from cramming.data.sources import fingerprinted_fields, load_source, source_fingerprint
from cramming.data.tokenizer import SpecialTokens, build_normalizer, train_tokenizer, word_inner_characters
from cramming.errors import DataSourceError
from cramming.utils import process_alive

log = logging.getLogger("cramming")

# Bump when a change to this module changes what a given config produces: old caches then stop matching.
# 2: the tokenizer's training texts are sampled across sources; texts empty after normalization are dropped.
# 3: WordPiece ids are renumbered in a fixed order (the trainer's differ between trainings on the same texts).
PIPELINE_VERSION = 3
# Written last; a cache folder without it is not complete.
STATS_FILE = "stats.json"
# Texts per batch in the map steps; big enough to amortize Python overhead, small enough for memory.
BATCH = 1000
# Documents per batch where they are tokenized and packed. What these steps hold scales with a batch's tokens
# (a Wikipedia article has about 3,500): at 1,000 documents a batch held 0.5 GB while it was tokenized and,
# packed 10,000 at a time, 0.7 GB, the peak of the whole pipeline; at 100 it is tens of MB, and neither step is
# slower (results/preprocessing/: scaling-before.md, scaling.md). The peak is then the tokenizer trainer's, which
# grows with the distinct words it trains on (data.tokenizer.max_train_entries bounds them), not the corpus.
DOC_BATCH = 100
# Roughly this many characters of text per preprocessing process before a second one pays off.
CHARS_PER_PROC = 8_000_000


@dataclass
class PretrainingData:
    """Packed MLM training rows and the tokenizer that made them."""

    path: Path
    # column `input_ids`: rows of exactly seq_length token ids (uint16 when the vocabulary allows)
    train: datasets.Dataset
    validation: datasets.Dataset | None
    tokenizer: Tokenizer
    seq_length: int
    stats: dict
    special: SpecialTokens = field(default_factory=SpecialTokens)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def identity(self) -> dict:
        """What a resumed run must find unchanged, by content (not by path: a moved cache is the same data):
        the tokenizer, the row length, the number of training rows and a hash of a fixed sample of them. The
        tokenizer's hash is that of its tokenizer.json (Tokenizer.save writes the pretty form), the value
        stats.json and the run card record."""
        return {
            "tokenizer_sha256": hashlib.sha256(self.tokenizer.to_str(pretty=True).encode()).hexdigest(),
            "seq_length": self.seq_length,
            "train_rows": len(self.train),
            "rows_sha256": _rows_sample_sha256(self.train),
        }


# Rows hashed by PretrainingData.identity: evenly spaced over the split, first and last included. Enough to
# tell other rows or another order apart, cheap for any size of data.
IDENTITY_SAMPLE_ROWS = 1024


def _rows_sample_sha256(rows: datasets.Dataset) -> str:
    n = len(rows)
    picked = np.unique(np.linspace(0, n - 1, num=min(n, IDENTITY_SAMPLE_ROWS)).round().astype(np.int64))
    sample = rows.with_format("numpy", columns=["input_ids"])[picked]["input_ids"]
    return hashlib.sha256(np.ascontiguousarray(sample, dtype=np.int64).tobytes()).hexdigest()


def cache_key(cfg: DataConfig, cache_root: str | os.PathLike | None = None) -> str:
    """Hash of everything that decides the processed data: the config (without its label, and without the
    paths of local files: their content stands for them) and the sources' fingerprints. `cache_root` keeps
    the hashes of local files, so that unchanged files are not read again."""
    resolved = asdict(cfg)
    resolved.pop("name")
    # options added later: at their defaults, the caches made before them keep their names
    for added_later in ("row_start", "segments"):
        if resolved.get(added_later) == "none":
            resolved.pop(added_later)
    for name, src in cfg.sources.items():
        for key in fingerprinted_fields(src):
            resolved["sources"][name].pop(key)
    payload = {
        "pipeline_version": PIPELINE_VERSION,
        "config": resolved,
        "sources": {name: source_fingerprint(src, cache_root) for name, src in cfg.sources.items()},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:12]


def cache_dir_for(cfg: DataConfig, cache_root: str | os.PathLike) -> Path:
    return Path(cache_root) / f"{cfg.name}-{cache_key(cfg, cache_root)}"


def prepare_pretraining_data(
    cfg: DataConfig, cache_root: str | os.PathLike, num_proc: int = 1
) -> PretrainingData:
    """Find the processed data for this config in the cache, or build it there; then load it."""
    path = cache_dir_for(cfg, cache_root)
    if (path / STATS_FILE).exists():
        log.info("found processed data for this data config at %s: skipping preprocessing", path)
    else:
        log.info("no processed data for this data config yet: preprocessing into %s", path)
        _build(cfg, path, Path(cache_root) / "hf", num_proc)
    return load_pretraining_data(path)


def load_pretraining_data(path: str | os.PathLike) -> PretrainingData:
    path = Path(path)
    if not (path / STATS_FILE).exists():
        raise DataSourceError(
            f"{path} holds no complete processed dataset. Run `python pretrain.py dryrun=true data=...` to build it."
        )
    splits = datasets.load_from_disk(str(path / "dataset"))
    stats = json.loads((path / STATS_FILE).read_text())
    return PretrainingData(
        path=path,
        train=splits["train"],
        validation=splits.get("validation"),
        tokenizer=Tokenizer.from_file(str(path / "tokenizer.json")),
        seq_length=stats["seq_length"],
        stats=stats,
    )


class _Steps:
    """Times each step and logs it with its throughput; the figures go into stats.json."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def step(self, name: str, megabytes: float | None = None) -> Iterator[None]:
        log.info("%s ...", name)
        start = time.perf_counter()
        yield
        took = time.perf_counter() - start
        self.seconds[name] = round(took, 3)
        rate = f" ({megabytes / took:.2f} MB/s)" if megabytes and took > 0 else ""
        log.info("%s done in %.1f s%s", name, took, rate)


def _arrow_column(ds: datasets.Dataset, column: str, rows: int = 10 * BATCH) -> Iterator[pa.Array]:
    """One column in Arrow batches of `rows` rows, with any row selection (indices mapping) of `ds` applied.
    A column of whole documents (text, token ids) is read BATCH rows at a time: 10,000 articles are 0.15 GB."""
    for table in ds.select_columns([column]).with_format("arrow").iter(batch_size=rows):
        yield table.column(column).combine_chunks()


def _numpy_column(ds: datasets.Dataset, column: str) -> np.ndarray:
    parts = [batch.to_numpy(zero_copy_only=False) for batch in _arrow_column(ds, column)]
    return np.concatenate(parts) if parts else np.empty(0)


def _text_megabytes(ds: datasets.Dataset) -> float:
    total = sum(
        pc.sum(pc.binary_length(batch.cast(pa.binary()))).as_py() or 0
        for batch in _arrow_column(ds, "text", BATCH)
    )
    return total / 1e6


def _clean(raw: datasets.Dataset, cfg: DataConfig, num_proc: int, scratch: Path) -> datasets.Dataset:
    """Normalize, drop texts that are empty or shorter than min_chars, and add a 64-bit hash of each text."""
    norm_cfg, min_chars = cfg.normalizer, cfg.filter.min_chars
    segment = SEGMENTS[cfg.segments]  # read on the raw text: the sentence rule wants its capital letters

    def clean(batch: dict[str, list[str]]) -> dict[str, list]:
        normalizer = build_normalizer(norm_cfg)  # cheap; built here so workers need not pickle it
        kept: dict[str, list] = {"text": [], "source": [], "hash": []}
        for text, source in zip(batch["text"], batch["source"], strict=True):
            if text and segment is not None:
                text = segment(text)
            text = normalizer.normalize_str(text).strip() if text else ""
            if text and len(text) >= min_chars:
                kept["text"].append(text)
                kept["source"].append(source)
                digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
                kept["hash"].append(int.from_bytes(digest, "little", signed=True))
        return kept

    features = datasets.Features(
        {
            "text": datasets.Value("string"),
            "source": datasets.Value("string"),
            "hash": datasets.Value("int64"),
        }
    )
    return raw.map(
        clean,
        batched=True,
        batch_size=BATCH,
        num_proc=num_proc if num_proc > 1 else None,
        features=features,
        cache_file_name=str(scratch / "clean.arrow"),
        desc="normalize + length filter",
    )


def _nothing_left(raw: datasets.Dataset, cfg: DataConfig) -> DataSourceError:
    """Say which step removed every text, with counts per step (a second pass, run only on this failure)."""
    sources = ", ".join(f"data.sources.{name}" for name in cfg.sources)
    if len(raw) == 0:
        return DataSourceError(f"{sources} gave no text at all: check the files or dataset they point at.")
    normalizer, min_chars = build_normalizer(cfg.normalizer), cfg.filter.min_chars
    empty = emptied = short = 0
    for batch in _text_batches(raw):
        for text in batch:
            if not text or not text.strip():
                empty += 1
            elif not (normalized := normalizer.normalize_str(text).strip()):
                emptied += 1
            elif len(normalized) < min_chars:
                short += 1
    fixes = ["add text"]
    if short:
        fixes.append(f"lower data.filter.min_chars (now {min_chars})")
    if emptied and cfg.normalizer.ascii_only:
        fixes.append("set data.normalizer.ascii_only=false to keep text in other scripts")
    return DataSourceError(
        f"no text is left to train on: of {len(raw)} entries read from {sources}, {empty} are empty, "
        f"{emptied} are empty after data.normalizer (ascii_only={cfg.normalizer.ascii_only} deletes every "
        f"non-ASCII character), and {short} are shorter than data.filter.min_chars={min_chars} characters "
        f"after normalization. Fix: {', or '.join(fixes)}."
    )


def _deduplicate(docs: datasets.Dataset) -> datasets.Dataset:
    """Keep the first occurrence of every normalized text (by 64-bit hash)."""
    hashes = _numpy_column(docs, "hash")
    _, first = np.unique(hashes, return_index=True)
    return docs.select(np.sort(first))


def _split_validation(
    docs: datasets.Dataset, cfg: DataConfig
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Hold out whole documents, so no validation text leaks into training rows."""
    n = len(docs)
    n_val = round(cfg.validation_fraction * n)
    if cfg.validation_fraction > 0 and n >= 2:
        n_val = max(1, n_val)
    if n_val == 0:
        return docs, None
    rng = np.random.default_rng(cfg.seed)
    val_idx = np.sort(rng.choice(n, size=n_val, replace=False))
    keep = np.ones(n, dtype=bool)
    keep[val_idx] = False
    return docs.select(np.flatnonzero(keep)), docs.select(val_idx)


def _text_batches(docs: datasets.Dataset) -> Iterator[list[str]]:
    for batch in docs.select_columns(["text"]).iter(batch_size=BATCH):
        yield batch["text"]


def _tokenizer_sample(docs: datasets.Dataset, limit: int | None, seed: int) -> datasets.Dataset:
    """At most `limit` documents, drawn at random from every source in proportion to its document count.

    Taking the first documents instead would train the tokenizer on the first source only (with
    wikibooks: Wikipedia's 6 M articles before BookCorpus). Each source's quota is its exact share, rounded
    by largest remainder; a uniform draw of documents also gives each source its share of the characters,
    in expectation.
    """
    if limit is None or limit >= len(docs):
        return docs
    sources = pa.chunked_array(list(_arrow_column(docs, "source"))).combine_chunks().dictionary_encode()
    codes = sources.indices.to_numpy()
    counts = np.bincount(codes, minlength=len(sources.dictionary))
    shares = limit * counts / counts.sum()
    quotas = np.floor(shares).astype(np.int64)
    by_remainder = np.argsort(-(shares - quotas), kind="stable")
    quotas[by_remainder[: limit - quotas.sum()]] += 1
    rng = np.random.default_rng([seed, 1])  # a stream apart from the validation split's
    picked = [rng.choice(np.flatnonzero(codes == k), size=q, replace=False) for k, q in enumerate(quotas)]
    return docs.select(np.sort(np.concatenate(picked)))


def _count_by_source(docs: datasets.Dataset) -> dict[str, int]:
    counts = pa.chunked_array(list(_arrow_column(docs, "source"))).value_counts()
    return {str(v["values"]): int(v["counts"]) for v in counts.to_pylist()}


def _tokenize(
    docs: datasets.Dataset, tokenizer: Tokenizer, id_type: str, scratch_file: Path, sep: int | None = None
) -> datasets.Dataset:
    """Token ids per document (no special tokens, but for `sep` after each line but the last when given:
    data.segments) and each document's tokens-per-character ratio (of its text's own tokens)."""
    # The texts are normalized already and normalization is idempotent: skip the tokenizer's own pass
    # (a quarter of the tokenizing time on Wikipedia). The packing test checks rows against raw text.
    prenormalized = Tokenizer.from_str(tokenizer.to_str())
    prenormalized.normalizer = None

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        # the fast form leaves out the character offsets, which would be most of the encodings' memory
        if sep is None:
            encodings = prenormalized.encode_batch_fast(batch["text"], add_special_tokens=False)
            ids = [enc.ids for enc in encodings]
            counts = [len(x) for x in ids]
        else:
            ids, counts = _tokenize_lines(prenormalized, batch["text"], sep)
        ratios = [n / max(1, len(text)) for n, text in zip(counts, batch["text"], strict=True)]
        return {"ids": ids, "tokens_per_char": ratios}

    features = datasets.Features(
        {"ids": datasets.Sequence(datasets.Value(id_type)), "tokens_per_char": datasets.Value("float32")}
    )
    return docs.map(
        tokenize,
        batched=True,
        batch_size=DOC_BATCH,
        writer_batch_size=DOC_BATCH,
        remove_columns=docs.column_names,
        features=features,
        cache_file_name=str(scratch_file),
        desc="tokenize",
    )


def _tokenize_lines(tokenizer: Tokenizer, texts: list[str], sep: int) -> tuple[list[list[int]], list[int]]:
    """(each text's lines tokenized and joined with `sep`, each text's count of tokens without the seps).
    Empty lines are skipped; all the lines of a batch go to the tokenizer at once."""
    lines = [[line for line in text.split("\n") if line.strip()] for text in texts]
    flat = tokenizer.encode_batch_fast([line for text in lines for line in text], add_special_tokens=False)
    ids, counts, at = [], [], 0
    for text in lines:
        joined, count = [], 0
        for k, enc in enumerate(flat[at : at + len(text)]):
            if k:
                joined.append(sep)
            joined += enc.ids
            count += len(enc.ids)
        at += len(text)
        ids.append(joined)
        counts.append(count)
    return ids, counts


def _drop_trash(tokenized: datasets.Dataset, cutoff: float | None) -> datasets.Dataset:
    """Drop documents above `cutoff` tokens per character (the cramming "trash" filter)."""
    if cutoff is not None:
        ratios = _numpy_column(tokenized, "tokens_per_char")
        tokenized = tokenized.select(np.flatnonzero(ratios <= cutoff))
    return tokenized.remove_columns("tokens_per_char")


def _token_count(tokenized: datasets.Dataset) -> int:
    return sum(
        int(pc.sum(pc.list_value_length(batch)).as_py() or 0)
        for batch in _arrow_column(tokenized, "ids", BATCH)
    )


def join_with_separator(values: np.ndarray, offsets: np.ndarray, sep: int) -> np.ndarray:
    """Documents given as flat `values` with `offsets` (n+1,) -> each document followed by `sep`. Beside the
    result it holds one byte per token (numpy's insertion mask), not an index per token."""
    return np.insert(values, offsets[1:], np.asarray(sep, dtype=values.dtype))


def _pack(
    tokenized: datasets.Dataset,
    seq_length: int,
    sep: int,
    id_type: str,
    out_file: Path,
    first_token: int | None = None,
) -> datasets.Dataset:
    """Join documents with [SEP] and cut the stream into rows of exactly seq_length; the last partial row is
    dropped. With `first_token` (data.row_start=cls: the [CLS] id), each row is that token followed by seq_length - 1
    tokens of the stream. Rows are streamed to an Arrow file, so memory stays at one batch of DOC_BATCH
    documents."""
    np_type = np.dtype(id_type)
    body = seq_length - (first_token is not None)  # stream tokens per row
    schema = pa.schema([("input_ids", pa.list_(pa.from_numpy_dtype(np_type), seq_length))])
    carry = np.empty(0, dtype=np_type)
    rows, last_log, start = 0, time.perf_counter(), time.perf_counter()
    with pa.OSFile(str(out_file), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for table in tokenized.with_format("arrow").iter(batch_size=DOC_BATCH):
            docs = table.column("ids").combine_chunks()  # ListArray: (docs,) of variable length
            offsets = docs.offsets.to_numpy()
            values = docs.flatten().to_numpy(zero_copy_only=False).astype(np_type, copy=False)
            stream = np.concatenate([carry, join_with_separator(values, offsets - offsets[0], sep)])
            n_rows = len(stream) // body
            if n_rows:
                cut = stream[: n_rows * body].reshape(n_rows, body)
                if first_token is not None:
                    cut = np.concatenate([np.full((n_rows, 1), first_token, dtype=np_type), cut], axis=1)
                flat = pa.array(cut.reshape(-1))
                writer.write_batch(
                    pa.record_batch([pa.FixedSizeListArray.from_arrays(flat, seq_length)], schema=schema)
                )
            carry = stream[n_rows * body :]
            rows += n_rows
            if time.perf_counter() - last_log > 10:
                last_log = time.perf_counter()
                log.info("packing: %d rows (%.0f rows/s)", rows, rows / (last_log - start))
    return datasets.Dataset.from_file(str(out_file))


def _order(rows: datasets.Dataset, cfg: DataConfig, vocab_size: int) -> datasets.Dataset:
    rows = ORDERINGS[cfg.ordering](rows, cfg.seed, vocab_size)
    if cfg.max_rows is not None and len(rows) > cfg.max_rows:
        rows = rows.select(range(cfg.max_rows))
    return rows


def _procs_for(megabytes: float, num_proc: int) -> int:
    return max(1, min(num_proc, int(megabytes * 1e6 // CHARS_PER_PROC) + 1))


def remove_abandoned_builds(path: Path) -> list[Path]:
    """Delete the `.{name}.building-<pid>` folders of `path` whose process is gone (killed outright while it
    preprocessed); a build still running on this machine is left alone."""
    removed = []
    for folder in path.parent.glob(f".{path.name}.building-*"):
        pid = folder.name.rpartition("-")[2]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    if removed:
        log.info("removed %d abandoned preprocessing folder(s): %s", len(removed), [str(p) for p in removed])
    return removed


def _build(cfg: DataConfig, path: Path, hf_cache: Path, num_proc: int) -> None:
    """Read, clean, train the tokenizer, tokenize and pack into a private folder, then publish it as `path`."""
    remove_abandoned_builds(path)
    build_dir = path.with_name(f".{path.name}.building-{os.getpid()}")
    scratch = build_dir / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    steps, stats = _Steps(), {"seq_length": cfg.seq_length, "cache_key": path.name}
    start = time.perf_counter()
    try:
        train_docs, val_docs, megabytes = _read_and_clean(cfg, hf_cache, num_proc, scratch, steps, stats)
        tokenizer = _fit_tokenizer(cfg, train_docs, steps, stats)
        splits, cutoff = {}, None  # validation uses the training split's trash cut-off
        for split, docs in (("train", train_docs), ("validation", val_docs)):
            if docs is not None:
                splits[split], cutoff = _tokenize_and_pack(
                    split, docs, cfg, tokenizer, cutoff, scratch, steps, stats
                )
        if stats["train_rows"] == 0:
            raise DataSourceError(
                f"only {stats['train_tokens']} tokens are left after filtering, fewer than one row of "
                f"{cfg.seq_length}: add text, lower data.filter.min_chars, or raise data.filter.max_tokens_per_char_vs_median"
            )
        with steps.step("save"):
            datasets.DatasetDict(splits).save_to_disk(str(build_dir / "dataset"))
            tokenizer.save(str(build_dir / "tokenizer.json"))
            (build_dir / "data_config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        stats["tokenizer_sha256"] = hashlib.sha256((build_dir / "tokenizer.json").read_bytes()).hexdigest()
        stats["seconds"] = steps.seconds | {"total": round(time.perf_counter() - start, 3)}
        stats["megabytes_per_second"] = round(megabytes / stats["seconds"]["total"], 3)
        shutil.rmtree(scratch)
        (build_dir / STATS_FILE).write_text(json.dumps(stats, indent=2))
        _publish(build_dir, path)
    except BaseException:
        shutil.rmtree(build_dir, ignore_errors=True)
        raise
    log.info(
        "preprocessed %.1f MB of text into %d training rows of %d tokens in %.1f s (%.2f MB/s)",
        megabytes,
        stats["train_rows"],
        cfg.seq_length,
        stats["seconds"]["total"],
        stats["megabytes_per_second"],
    )


def load_raw_corpus(cfg: DataConfig, hf_cache: Path) -> datasets.Dataset:
    """All sources of the data config, concatenated in the order they are listed; column `source` names
    each entry's source."""
    parts = []
    for name, source in cfg.sources.items():
        ds = load_source(source, hf_cache)
        log.info("source %s (%s): %d entries", name, source.kind, len(ds))
        parts.append(ds.add_column("source", [name] * len(ds)))
    return datasets.concatenate_datasets(parts)


def _read_and_clean(
    cfg: DataConfig, hf_cache: Path, num_proc: int, scratch: Path, steps: _Steps, stats: dict
) -> tuple[datasets.Dataset, datasets.Dataset | None, float]:
    """(training documents, validation documents or None, megabytes read): read, normalize, filter, dedup."""
    with steps.step("read sources"):
        raw = load_raw_corpus(cfg, hf_cache)
    megabytes = _text_megabytes(raw)
    stats.update(raw_documents=len(raw), raw_megabytes=round(megabytes, 3))
    with steps.step("normalize + length filter", megabytes):
        docs = _clean(raw, cfg, _procs_for(megabytes, num_proc), scratch)
    stats["documents_after_length_filter"] = len(docs)
    if len(docs) == 0:
        raise _nothing_left(raw, cfg)
    if cfg.filter.deduplicate:
        with steps.step("deduplicate"):
            docs = _deduplicate(docs)
    stats["documents_after_dedup"] = len(docs)
    train_docs, val_docs = _split_validation(docs, cfg)
    return train_docs, val_docs, megabytes


def _fit_tokenizer(cfg: DataConfig, train_docs: datasets.Dataset, steps: _Steps, stats: dict) -> Tokenizer:
    """The tokenizer, trained on a seeded sample of the training documents drawn from every source."""
    tok_docs = _tokenizer_sample(train_docs, cfg.tokenizer.max_train_entries, cfg.seed)
    stats["tokenizer_train_documents"] = _count_by_source(tok_docs)
    stats["tokenizer_train_megabytes"] = round(_text_megabytes(tok_docs), 3)
    log.info(
        "training the tokenizer on %d of %d training documents: %s",
        len(tok_docs),
        len(train_docs),
        ", ".join(f"{n} from {name}" for name, n in stats["tokenizer_train_documents"].items()),
    )
    with steps.step("train tokenizer", stats["tokenizer_train_megabytes"]):
        # WordPiece's ##pieces numbered before training: the same vocabulary from the same texts every time
        inner = word_inner_characters(_text_batches(tok_docs)) if cfg.tokenizer.kind == "wordpiece" else ()
        return train_tokenizer(
            _text_batches(tok_docs), cfg.tokenizer, cfg.normalizer, len(tok_docs), inner_chars=inner
        )


def _tokenize_and_pack(
    split: str,
    docs: datasets.Dataset,
    cfg: DataConfig,
    tokenizer: Tokenizer,
    cutoff: float | None,
    scratch: Path,
    steps: _Steps,
    stats: dict,
) -> tuple[datasets.Dataset, float | None]:
    """(rows of one split, the trash cut-off): tokenize, drop documents above the cut-off (set on the
    training split, passed in for validation), pack; the training rows are also ordered and capped."""
    id_type = "uint16" if tokenizer.get_vocab_size() <= 2**16 else "int32"
    with steps.step(f"tokenize {split}", _text_megabytes(docs)):
        sep = None if cfg.segments == "none" else SpecialTokens().sep
        tokenized = _tokenize(docs, tokenizer, id_type, scratch / f"tok-{split}.arrow", sep)
    factor = cfg.filter.max_tokens_per_char_vs_median
    if factor is not None and split == "train":
        median = float(np.median(_numpy_column(tokenized, "tokens_per_char")))
        cutoff = factor * median
        stats.update(median_tokens_per_char=round(median, 4), trash_cutoff_tokens_per_char=round(cutoff, 4))
    tokenized = _drop_trash(tokenized, cutoff)
    with steps.step(f"pack {split}"):
        special = SpecialTokens()
        first = special.cls if cfg.row_start == "cls" else None
        rows = _pack(tokenized, cfg.seq_length, special.sep, id_type, scratch / f"rows-{split}.arrow", first)
    stats[f"{split}_documents"] = len(tokenized)
    stats[f"{split}_dropped_by_token_ratio"] = len(docs) - len(tokenized)
    stats[f"{split}_tokens"] = _token_count(tokenized) + len(
        tokenized
    )  # every document is followed by one [SEP]
    if split == "train":
        with steps.step("order + cap rows"):
            rows = _order(rows, cfg, tokenizer.get_vocab_size())
    stats[f"{split}_rows"] = len(rows)
    return rows, cutoff


def _publish(build_dir: Path, path: Path) -> None:
    """Rename the finished folder into place; if another process got there first, keep theirs."""
    try:
        os.rename(build_dir, path)
    except OSError:
        if not (path / STATS_FILE).exists():
            raise
        log.info("another process finished the same data first; using its copy")
        shutil.rmtree(build_dir, ignore_errors=True)
