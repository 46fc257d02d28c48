"""Every `python pretrain.py ...` / `python eval.py ...` command in the README and docs/ composes as a Hydra
config and validates: a renamed key or group breaks this test, not a reader's first try."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from cramming.config import CONF_DIR, register_configs, validate
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
def test_documented_command_composes(line):
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
    if entry == "pretrain":
        validate(cfg)
    else:
        validate(cfg, EvalRunConfig)


def test_overrides_of_takes_a_sweeps_first_value_and_fills_placeholders():
    entry, overrides = overrides_of(
        "python eval.py -m +sweep=glue-optimizers checkpoint=<run folder> seed=1,2  # x"
    )
    assert entry == "eval" and overrides == ["+sweep=glue-optimizers", "checkpoint=placeholder", "seed=1"]
