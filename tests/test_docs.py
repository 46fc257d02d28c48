"""Every `python pretrain.py ...` / `python eval.py ...` command in the README and docs/ composes as a Hydra
config and validates, and every setting the pages and conf/'s comments name (`train.optim.lr`, `impl.num_proc`)
exists: a renamed key or group breaks this test, not a reader's first try. Nothing a user reads names the data
beside our own checkouts."""

from __future__ import annotations

import dataclasses
import re
import shlex
import tempfile
import types
import typing
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from cramming.config import CONF_DIR, PretrainConfig, register_configs, validate
from cramming.eval.config import EvalRunConfig

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PLACEHOLDER = "placeholder"  # stands for `<run folder>` and the like
ENTRY = re.compile(r"(?:^|\s)(pretrain|eval)\.py(\s|$)")


def code_lines(text: str) -> list[str]:
    """Lines of fenced and indented code blocks, with backslash continuations joined."""
    lines, fenced, pending = [], False, ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not (fenced or raw.startswith("    ")):
            continue
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        lines.append(line)
    return lines


def documented_commands() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for line in code_lines(page.read_text()):
            if ENTRY.search(line) and (line.startswith("python ") or line.startswith("torchrun ")):
                found.append((f"{page.relative_to(REPO)}: {line}", line))
    return found


def overrides_of(line: str) -> tuple[str, list[str]]:
    """(entry point, overrides): `-m` dropped, `<placeholders>` as a plain word, a sweep's first value."""
    words = shlex.split(re.sub(r"<[^>]*>", PLACEHOLDER, line), comments=True)
    entry = next(w for w in words if w.endswith(("pretrain.py", "eval.py")))
    args = [w for w in words[words.index(entry) + 1 :] if w not in ("-m", "--multirun")]
    args = [a for a in args if not a.endswith("...") and a != "..."]
    parsed = OverridesParser.create().parse_overrides(args)
    first = []
    for override in parsed:
        if override.is_sweep_override():
            value = next(iter(override.sweep_string_iterator()))
            first.append(f"{override.get_key_element()}={value}")
        else:
            first.append(override.input_line)
    return Path(entry).stem, first


COMMANDS = documented_commands()


def test_the_pages_document_commands():
    assert len(COMMANDS) >= 20, [name for name, _ in COMMANDS]


@pytest.mark.parametrize("line", [line for _, line in COMMANDS], ids=[name[:90] for name, _ in COMMANDS])
def test_documented_command_composes(line, tmp_path, monkeypatch):
    register_configs()
    entry, overrides = overrides_of(line)
    if any(o.startswith("hydra/launcher=") or o.startswith("hydra.launcher.") for o in overrides):
        pytest.importorskip(
            "hydra_plugins.hydra_submitit_launcher", reason="the cluster extra is not installed"
        )
    if any(o.startswith(("+sweep=glue-lr-search", "+sweep=glue-galore-search")) for o in overrides):
        pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="the cluster extra is not installed")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("pretrain" if entry == "pretrain" else "eval", overrides=overrides)
    # a command that reads a data folder (eval.glue_dir=data/glue, made by scripts/get_data.py) is checked for
    # its configuration, not for the folder: validate where the folders it names exist, empty
    workdir = tmp_path / "work"
    for folder in data_folders(cfg):
        (workdir / folder).mkdir(parents=True, exist_ok=True)
    workdir.mkdir(exist_ok=True)
    monkeypatch.chdir(workdir)
    validate(cfg) if entry == "pretrain" else validate(cfg, EvalRunConfig)


def data_folders(cfg) -> list[str]:
    """The relative folders a composed config reads GLUE from (eval.glue_dir, anytime.recipe.glue_dir)."""
    found = [
        str(f) for f in (OmegaConf.select(cfg, k) for k in ("eval.glue_dir", "anytime.recipe.glue_dir")) if f
    ]
    outside = [f for f in found if Path(f).is_absolute() or ".." in Path(f).parts]
    assert not outside, f"a documented command reads data from outside the project: {outside}"
    return found


def test_overrides_of_takes_a_sweeps_first_value_and_fills_placeholders():
    entry, overrides = overrides_of(
        "python eval.py -m +sweep=glue-optimizers checkpoint=<run folder> seed=1,2  # x"
    )
    assert entry == "eval" and overrides == ["+sweep=glue-optimizers", "checkpoint=placeholder", "seed=1"]


# ---------------------------------------------------------------------------- the settings the pages name

# Where settings are named: the pages' code (inline and blocks), the scripts' index, and the comments of conf/.
KEY_PAGES = [*PAGES, REPO / "scripts" / "README.md", *sorted(CONF_DIR.rglob("*.yaml"))]
SCHEMAS = (PretrainConfig, EvalRunConfig)
# A dotted key starts at a section of a schema (train., eval., impl., data., ...), or at `optim.`, which is none
# (the settings are train.optim.* and eval.optim.*) but reads like one.
SECTIONS = sorted(
    {
        name
        for schema in SCHEMAS
        for name, kind in typing.get_type_hints(schema).items()
        if dataclasses.is_dataclass(kind)
    }
    | {"optim"}
)
SEGMENT = r"(?:[A-Za-z_]\w*|<[^<>\s`]+>)"  # a name, or a <placeholder> (data.sources.<name>.files)
DOTTED_KEY = re.compile(rf"(?<![\w./\\$%{{:-])(?:{'|'.join(SECTIONS)})(?:\.{SEGMENT})+")
# eval.py, data.md, train.tsv: files, not settings
FILE_SUFFIXES = {"py", "md", "yaml", "json", "jsonl", "log", "tsv", "csv", "txt", "sh", "pt", "png", "gz"}


def named_settings(path: Path) -> set[str]:
    """The dotted keys a page names in its code, or a YAML file in its comments."""
    text = path.read_text()
    if path.suffix == ".yaml":
        pieces = [line.split("#", 1)[1] for line in text.splitlines() if "#" in line]
    else:
        pieces = re.findall(r"`([^`\n]+)`", text) + code_lines(text)
    found = {key for piece in pieces for key in DOTTED_KEY.findall(piece)}
    return {key for key in found if key.rsplit(".", 1)[1] not in FILE_SUFFIXES}


def setting_problem(key: str) -> str | None:
    """None when `key` is a setting of pretraining or evaluation (an entry of a dict, such as
    data.sources.<name>, takes any name); else why it is not."""
    problems = [_walk(schema, key.split(".")) for schema in SCHEMAS]
    return None if None in problems else max(problems, key=lambda p: p[0])[1]


def _walk(kind: type, parts: list[str]) -> tuple[int, str] | None:
    """None when `parts` lead through `kind`'s fields; else (how far they got, what stopped them)."""
    for depth, part in enumerate(parts):
        kind = _without_none(kind)
        if dataclasses.is_dataclass(kind):
            fields = typing.get_type_hints(kind)
            if part.startswith("<") and depth == len(parts) - 1:  # train.optim.<key>: any of its fields
                return None
            if part not in fields:
                return depth, f"{kind.__name__} has no field {part!r}"
            kind = fields[part]
        elif typing.get_origin(kind) is dict:
            kind = typing.get_args(kind)[1]
        else:
            return depth, f"{'.'.join(parts[:depth])} is a plain value, without {part!r} below it"
    return None


def _without_none(kind: type) -> type:
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1 else kind


@pytest.mark.parametrize("path", KEY_PAGES, ids=[str(p.relative_to(REPO)) for p in KEY_PAGES])
def test_every_setting_a_page_names_exists(path):
    unknown = {key: problem for key in sorted(named_settings(path)) if (problem := setting_problem(key))}
    assert not unknown, f"{path.relative_to(REPO)} names settings that do not exist: {unknown}"


def test_the_setting_check_finds_renamed_and_misplaced_keys():
    text = "`train.optim.lr=1e-3`, `eval.glue_dir=data/glue`, `impl.num_proc`, `data.sources.<name>.files`, `eval.py`"
    assert named_settings_of(text) == {
        "train.optim.lr", "eval.glue_dir", "impl.num_proc", "data.sources.<name>.files"
    }  # fmt: skip
    assert [setting_problem(k) for k in sorted(named_settings_of(text))] == [None] * 4
    assert setting_problem("impl.preprocessing_procs")  # a property of ImplConfig, not a setting
    assert setting_problem("optim.backend") and setting_problem("train.optim.backend") is None
    assert setting_problem("eval.glue_dir.tasks") and setting_problem("data.<name>.files")
    assert setting_problem("train.optim.<key>") is None and setting_problem("train.<section>.lr")
    assert not named_settings_of("`cramming.optim.layerwise`, `torch.optim.AdamW`, `cramming/train/loop.py`")


def named_settings_of(text: str) -> set[str]:
    page = Path(tempfile.mkdtemp()) / "page.md"
    page.write_text(text)
    return named_settings(page)


# ------------------------------------------------------------------------------- what a fresh clone has

# What a user reads or runs; none of it may point at the data our own machines keep beside the project
# (tests find that through CRAMMING_DATA, tests/conftest.py)
USER_FACING = ["README.md", "Makefile", "pretrain.py", "eval.py", "docs", "conf", "cramming", "scripts"]
BESIDE_OUR_CHECKOUTS = re.compile(r"\.\./shared\b")


def lines_naming_our_data(files: list[Path]) -> list[str]:
    """`path:line` of every line of `files` that names the data beside our checkouts."""
    return [
        f"{path.relative_to(REPO)}:{n}"
        for path in files
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if BESIDE_OUR_CHECKOUTS.search(line)
    ]


def test_no_user_facing_file_names_the_data_beside_our_checkouts():
    files = [
        path
        for name in USER_FACING
        for path in ([REPO / name] if (REPO / name).is_file() else sorted((REPO / name).rglob("*")))
        if path.is_file() and path.suffix in ("", ".md", ".py", ".yaml", ".sh")
    ]
    assert len(files) > 100
    found = lines_naming_our_data(files)
    assert not found, f"name data a fresh clone has (data/, made by scripts/get_data.py) instead: {found}"


def test_no_results_page_names_the_data_beside_our_checkouts():
    """A results page's replay lines are copied by users: they name data/... as scripts/get_data.py makes it.
    The kept run records (results/*/runs/) may keep the paths that ran."""
    pages = [p for p in sorted((REPO / "results").rglob("*.md")) if "runs" not in p.relative_to(REPO).parts]
    assert len(pages) > 20
    found = lines_naming_our_data(pages)
    assert not found, f"name data as a user makes it (data/..., scripts/get_data.py) instead: {found}"


# `pip install .[hf]` is a glob in zsh (macOS's shell), which fails with "no matches found": quote the extra
UNQUOTED_EXTRA = re.compile(r"pip install (?:-e )?\.\[")


def test_every_pip_install_of_an_extra_is_quoted():
    files = [REPO / "README.md", REPO / "Makefile", *sorted((REPO / "docs").glob("*.md"))]
    code = [p for name in ("conf", "cramming", "scripts") for p in sorted((REPO / name).rglob("*"))]
    # scripts/studies/ is being replaced by the study command; what replaces it is checked here once it lands
    files += [p for p in code if p.suffix in (".py", ".yaml") and "studies" not in p.parts]
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for path in files
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if UNQUOTED_EXTRA.search(line)
    ]
    assert not found, f"quote the extra, as pip install -e '.[hf]': {found}"
