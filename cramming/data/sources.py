"""Read raw text from the hub, from local files or from the embedded corpus into one `datasets.Dataset`.

Every source ends up as a Dataset with a single string column `text`. Each source also has a fingerprint:
what its content depends on besides the config (the local files' bytes, the Python version), so that changed
files make a new cache even when the config is the same, and the same files at another path find theirs. SourceConfig, the schema of one
`data.sources.<name>` entry, lives here beside SOURCE_KINDS and TXT_UNITS, the names it accepts.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import hashlib
import json
import logging
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets

from cramming.data import embedded
from cramming.errors import (
    DataSourceError,
    WriteFailed,
    check_choice,
    check_readable,
    config_error,
    stops_unwrapped,
)
from cramming.utils import atomic_write_text

log = logging.getLogger("cramming")

TEXT_FEATURES = datasets.Features({"text": datasets.Value("string")})

# file ending -> `datasets` builder that reads it
LOCAL_FORMATS = {
    ".txt": "text",
    ".jsonl": "json",
    ".jsonl.gz": "json",
    ".json": "json",
    ".parquet": "parquet",
}

# .txt files: what one entry is (the `sample_by` of the `datasets` text builder)
TXT_UNITS = ("line", "paragraph", "document")

OFFLINE_HINT = (
    "Without network, train on the embedded corpus (`python pretrain.py data=embedded`) or on local files "
    "(`python pretrain.py data=local data.sources.local.files='/path/to/*.jsonl.gz'`)."
)


@dataclass
class SourceConfig:
    """One raw-text source. Several sources are concatenated in the order of their names."""

    kind: str = "local"  # hub, local or embedded (the keys of SOURCE_KINDS)
    # hub: dataset path on the Hugging Face hub, e.g. "wikimedia/wikipedia"
    path: str | None = None
    # hub: subset / configuration name, e.g. "20231101.en"
    subset: str | None = None
    # hub: the split to read
    split: str = "train"
    # hub: stream instead of downloading the whole corpus (needs max_entries to stay bounded)
    streaming: bool = False
    # hub: a commit, tag or branch to pin the data version (results depend on it)
    revision: str | None = None
    # local: a folder or a glob of .txt, .jsonl, .jsonl.gz, .json or .parquet files
    files: str | None = None
    # name of the column / JSON field that holds the text
    text_field: str = "text"
    # .txt files: one entry per line, per blank-line separated paragraph, or per file
    txt_unit: str = "paragraph"
    # cap on raw entries taken from this source (None: all)
    max_entries: int | None = None
    # join every n consecutive entries into one document (sentence-per-row corpora such as BookCorpus)
    join_entries: int = 1

    def check(self, key: str) -> None:
        """Validate; `key` is where this source sits in the config, e.g. data.sources.local."""
        check_choice(f"{key}.kind", self.kind, SOURCE_KINDS)
        check_choice(f"{key}.txt_unit", self.txt_unit, TXT_UNITS)
        if self.kind == "hub" and not self.path:
            raise config_error(
                f"{key}.path", self.path, "a hub source needs `path`, e.g. wikimedia/wikipedia"
            )
        if self.kind == "local" and not self.files:
            raise config_error(
                f"{key}.files",
                self.files,
                f"a local source needs a folder or glob of files, e.g. {key}.files='/data/*.jsonl.gz'",
            )
        if self.max_entries is not None and self.max_entries < 1:
            raise config_error(f"{key}.max_entries", self.max_entries, "use a positive count or null")
        if self.join_entries < 1:
            raise config_error(f"{key}.join_entries", self.join_entries, "use 1 (no joining) or more")


def _format_of(path: str) -> str | None:
    for ending, builder in LOCAL_FORMATS.items():
        if path.endswith(ending):
            return builder
    return None


def resolve_local_files(pattern: str) -> list[str]:
    """A folder (searched recursively) or a glob, to a sorted list of readable files. A folder or file this
    process may not read is an error naming it (a folder it may not list would look empty)."""
    expanded = os.path.expanduser(pattern)
    setting = "data.sources.<name>.files"
    if os.path.isdir(expanded):
        check_readable(expanded, setting)
        candidates = glob.glob(os.path.join(expanded, "**", "*"), recursive=True)
    else:
        check_readable(_fixed_part(expanded), setting)
        candidates = glob.glob(expanded, recursive=True)
    files = sorted(p for p in candidates if os.path.isfile(p) and _format_of(p))
    for path in files:
        check_readable(path, setting)
    if not files:
        raise DataSourceError(
            f"no readable text files match {pattern!r} (looked for {', '.join(LOCAL_FORMATS)}). "
            "Point data.sources.<name>.files at a folder or a glob of such files; `python scripts/get_data.py"
            " wikipedia` makes the CPU study's shards in data/wikipedia (what +sweep=cpu-study reads)."
        )
    return files


def _fixed_part(pattern: str) -> str:
    """The folder a glob searches: its path up to the first part with a wildcard."""
    parts = Path(pattern).parts
    fixed = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    return str(Path(*parts[:fixed])) if fixed else "."


# In the data cache root: the SHA-256 of each local file hashed so far, with the size and times it had then. A
# file whose size and times are unchanged is not read again; the hash alone decides the cache.
FILE_HASHES = ".file_hashes.json"
# Log the hashing when at least this much is to be read (a multi-GB corpus takes seconds per GB, once).
HASH_LOG_BYTES = 256 << 20


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def _stat_key(path: str) -> list[int]:
    """What says a file is unchanged since it was hashed: its size, modification and change times (the change
    time moves with any write, even one that puts the modification time back)."""
    stat = os.stat(path)
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def _read_hashes(index: Path) -> dict[str, dict]:
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):  # none yet, or damaged: it is only a shortcut
        return {}
    return known if isinstance(known, dict) else {}


def content_hashes(files: list[str], cache_root: str | os.PathLike | None = None) -> list[str]:
    """The SHA-256 of each file's bytes. With a cache root, a file whose size and times are those its
    FILE_HASHES index recorded keeps its recorded hash; the files hashed anew are added to the index."""
    index = Path(cache_root) / FILE_HASHES if cache_root is not None else None
    known = _read_hashes(index) if index is not None else {}
    stats = {path: _stat_key(path) for path in files}

    def recorded(path: str) -> str | None:
        entry = known.get(os.path.abspath(path))
        if not isinstance(entry, dict) or entry.get("stat") != stats[path]:
            return None
        return entry.get("sha256") if isinstance(entry.get("sha256"), str) else None

    hashes = {path: recorded(path) for path in files}
    todo = [path for path, digest in hashes.items() if digest is None]
    size = sum(stats[path][0] for path in todo)
    if size >= HASH_LOG_BYTES:
        log.info("hashing %d file(s), %.1f GB, to find their processed data (once)", len(todo), size / 1e9)
    fresh = {}
    for path in todo:
        hashes[path] = file_sha256(path)
        fresh[os.path.abspath(path)] = {"stat": stats[path], "sha256": hashes[path]}
    if fresh and index is not None:
        # merged into the index as it is now (a parallel job may have added files); files gone are forgotten
        kept = {path: entry for path, entry in _read_hashes(index).items() if os.path.exists(path)}
        try:
            atomic_write_text(index, json.dumps(kept | fresh, indent=0))
        except WriteFailed as err:  # hashed again next time; writing the data folder reports the disk
            log.debug("the file hashes are not kept: %s", err)
    return [hashes[path] for path in files]


def _local_fingerprint(cfg: SourceConfig, cache_root: str | os.PathLike | None) -> str:
    """The files' content in the order they are read, each with the reader its ending chooses: not their paths
    nor their times, so the same files copied elsewhere find their cache and a changed byte does not. Empty
    files are left out, as they are when read."""
    files = [path for path in resolve_local_files(cfg.files) if os.path.getsize(path) > 0]
    hashes = content_hashes(files, cache_root)
    return json.dumps([[_format_of(path), digest] for path, digest in zip(files, hashes, strict=True)])


def _hub_fingerprint(cfg: SourceConfig, cache_root: str | os.PathLike | None) -> str:
    return f"hub:{cfg.path}:{cfg.subset}:{cfg.split}:{cfg.revision}"


def _embedded_fingerprint(cfg: SourceConfig, cache_root: str | os.PathLike | None) -> str:
    return embedded.fingerprint()


def _select_text(ds: datasets.Dataset, cfg: SourceConfig, where: str) -> datasets.Dataset:
    if cfg.text_field not in ds.column_names:
        raise DataSourceError(
            f"{where} has no field {cfg.text_field!r}; its fields are {ds.column_names}. "
            "Set data.sources.<name>.text_field to the one that holds the text."
        )
    kind = ds.features[cfg.text_field]
    if not (isinstance(kind, datasets.Value) and kind.dtype in ("string", "large_string")):
        raise DataSourceError(
            f"{where}: field {cfg.text_field!r} holds {_feature_name(kind)}, not text. Set"
            " data.sources.<name>.text_field to the field that holds the documents' text"
        )
    ds = ds.select_columns([cfg.text_field])
    if cfg.text_field != "text":
        ds = ds.rename_column(cfg.text_field, "text")
    return ds.cast(TEXT_FEATURES)


def _feature_name(feature: object) -> str:
    return f"{feature.dtype} values" if isinstance(feature, datasets.Value) else type(feature).__name__


def _cap(ds: datasets.Dataset, max_entries: int | None) -> datasets.Dataset:
    if max_entries is not None and len(ds) > max_entries:
        ds = ds.select(range(max_entries))
    return ds


def _without_empty_files(files: list[str]) -> list[str]:
    """Leave out files of 0 bytes (`datasets` fails on them with no file name); all of them empty is an error."""
    empty = [f for f in files if os.path.getsize(f) == 0]
    if not empty:
        return files
    shown = ", ".join(empty[:3]) + (f" and {len(empty) - 3} more" if len(empty) > 3 else "")
    if len(empty) == len(files):
        raise DataSourceError(
            f"every file of the source is empty (0 bytes): {shown}. "
            "Point data.sources.<name>.files at files that hold text."
        )
    log.warning("leaving out %d empty file(s) (0 bytes): %s", len(empty), shown)
    return [f for f in files if f not in empty]


def _first_undecodable(path: str) -> tuple[int, int] | None:
    """(offset, value) of the first byte that is not valid UTF-8 in a (gzipped) text file, or None."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes read so far
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            held = len(decoder.buffer)  # the start of a sequence held back from the previous chunk
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:  # err.object is the held bytes + this chunk
                return offset - held + err.start, err.object[err.start]
            if not chunk:
                return None
            offset += len(chunk)


def _unreadable(path: str) -> str | None:
    """Why a file cannot be read through to its end (not gzip, cut short, no permission), or None."""
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
            while f.read(1 << 20):
                pass
    except gzip.BadGzipFile:
        return "is not gzip-compressed (rename it without .gz if it is plain text, or compress it with gzip)"
    except EOFError:
        return (
            "is cut short: its gzip stream ends early (a copy or download that did not finish). Copy it again"
        )
    except (OSError, zlib.error) as err:
        return f"cannot be read ({err.strerror or err}). Check the file and its permissions"
    return None


def _read_error(builder: str, group: list[str], err: Exception) -> DataSourceError:
    """Name the file and the problem behind a `datasets` failure ("An error occurred while generating...")."""
    for path in group:
        why = _unreadable(path)
        if why is not None:
            return DataSourceError(f"{path} {why}, or remove it from data.sources.<name>.files")
    if builder in ("text", "json"):
        for path in group:
            bad = _first_undecodable(path)
            if bad is not None:
                offset, byte = bad
                return DataSourceError(
                    f"{path} is not UTF-8 text: byte 0x{byte:02x} at offset {offset} cannot be decoded "
                    "(a binary file, or another encoding). Remove it from the source or convert it to UTF-8."
                )
    cause = err
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__
    detail = f"{err}" if cause is err else f"{err} ({type(cause).__name__}: {cause})"
    return DataSourceError(
        f"could not read {len(group)} {builder} file(s) starting with {group[0]}: {detail}"
    )


def _load_local(cfg: SourceConfig, hf_cache: Path) -> datasets.Dataset:
    files = _without_empty_files(resolve_local_files(cfg.files))
    by_builder: dict[str, list[str]] = {}
    for f in files:
        by_builder.setdefault(_format_of(f), []).append(f)
    parts = []
    for builder, group in sorted(by_builder.items()):
        kwargs = {"sample_by": cfg.txt_unit} if builder == "text" else {}
        try:
            with stops_unwrapped():  # a stop signal landing inside `datasets` is not a malformed file
                ds = datasets.load_dataset(
                    builder, data_files=group, split="train", cache_dir=str(hf_cache), **kwargs
                )
        except Exception as err:  # a malformed file: find it and say what is wrong with it
            raise _read_error(builder, group, err) from err
        parts.append(_select_text(ds, cfg, f"{builder} file {group[0]}"))
        if cfg.max_entries is not None and sum(len(p) for p in parts) >= cfg.max_entries:
            break
    return _cap(datasets.concatenate_datasets(parts), cfg.max_entries)


def _iter_stream(stream: datasets.IterableDataset, field: str, where: str) -> Iterator[dict[str, str]]:
    for example in stream:
        if field not in example:
            raise DataSourceError(
                f"{where} has no field {field!r}; its fields are {sorted(example)}. "
                "Set data.sources.<name>.text_field to the one that holds the text."
            )
        yield {"text": example[field]}


def _load_hub(cfg: SourceConfig, hf_cache: Path) -> datasets.Dataset:
    where = f"hub dataset {cfg.path}" + (f" ({cfg.subset})" if cfg.subset else "")
    try:
        with stops_unwrapped():  # a stop signal landing inside `datasets` is not a network failure
            ds = datasets.load_dataset(
                cfg.path,
                cfg.subset,
                split=cfg.split,
                streaming=cfg.streaming,
                revision=cfg.revision,
                cache_dir=str(hf_cache),
            )
            if not cfg.streaming:
                return _cap(_select_text(ds, cfg, where), cfg.max_entries)
            if cfg.max_entries is None:
                log.warning("streaming all of %s: set data.sources.<name>.max_entries to bound it", where)
            else:
                ds = ds.take(cfg.max_entries)
            # materialize the stream as Arrow on disk, so the later steps can memory-map it
            return datasets.Dataset.from_generator(
                _iter_stream,
                gen_kwargs={"stream": ds, "field": cfg.text_field, "where": where},
                features=TEXT_FEATURES,
                cache_dir=str(hf_cache),
            )
    except ConnectionError as err:  # also what `datasets` raises in offline mode
        raise DataSourceError(
            f"could not reach the Hugging Face hub for {where}: {err}. {OFFLINE_HINT}"
        ) from err
    except datasets.exceptions.DatasetGenerationError as err:  # raised inside the stream
        cause = err.__cause__ or err
        if isinstance(cause, DataSourceError):
            raise cause from None
        raise DataSourceError(f"streaming {where} failed: {cause}. {OFFLINE_HINT}") from err


def _load_embedded(cfg: SourceConfig, hf_cache: Path) -> datasets.Dataset:
    texts = [doc["text"] for doc in embedded.iter_stdlib_docs()]
    return _cap(datasets.Dataset.from_dict({"text": texts}, features=TEXT_FEATURES), cfg.max_entries)


def _join_entries(ds: datasets.Dataset, n: int) -> datasets.Dataset:
    """Join every n consecutive entries into one document (for sentence-per-row corpora)."""

    def join(batch: dict[str, list[str]]) -> dict[str, list[str]]:
        texts = batch["text"]
        return {"text": ["\n".join(texts[i : i + n]) for i in range(0, len(texts), n)]}

    return ds.map(join, batched=True, batch_size=n * 1000, desc=f"joining every {n} entries")


@dataclass(frozen=True)
class SourceKind:
    """How one kind of source is read, and what its content depends on beyond its config."""

    load: Callable[[SourceConfig, Path], datasets.Dataset]
    # no network needed: the files' content, a hub revision, the Python version; given the data cache root,
    # where local files keep their hashes
    fingerprint: Callable[[SourceConfig, str | os.PathLike | None], str]
    # the config fields the fingerprint stands for in the cache key (a local source's path: a copy elsewhere
    # is the same data)
    replaced: tuple[str, ...] = ()


# data.sources.<name>.kind -> how to read it
SOURCE_KINDS: dict[str, SourceKind] = {
    "hub": SourceKind(load=_load_hub, fingerprint=_hub_fingerprint),
    "local": SourceKind(load=_load_local, fingerprint=_local_fingerprint, replaced=("files",)),
    "embedded": SourceKind(load=_load_embedded, fingerprint=_embedded_fingerprint),
}


def _kind_of(cfg: SourceConfig) -> SourceKind:
    check_choice("data.sources.<name>.kind", cfg.kind, SOURCE_KINDS)
    return SOURCE_KINDS[cfg.kind]


def source_fingerprint(cfg: SourceConfig, cache_root: str | os.PathLike | None = None) -> str:
    """What the source's content depends on beyond its config (no network needed). `cache_root`: the data
    cache root, where the hashes of local files are kept so that unchanged files are not read again."""
    return _kind_of(cfg).fingerprint(cfg, cache_root)


def fingerprinted_fields(cfg: SourceConfig) -> tuple[str, ...]:
    """The fields of the source's config that its fingerprint stands for, left out of the cache key."""
    return _kind_of(cfg).replaced


def load_source(cfg: SourceConfig, hf_cache: Path) -> datasets.Dataset:
    ds = _kind_of(cfg).load(cfg, hf_cache)
    if cfg.join_entries > 1:
        ds = _join_entries(ds, cfg.join_entries)
    return ds
