"""The settings reference, docs/settings.md, written from the typed schemas so that it cannot drift from them.

    python -m cramming.settings_reference           # rewrite docs/settings.md
    python -m cramming.settings_reference --check   # exit 1 when the page is not what the schemas give

Every key of `python pretrain.py` (cramming.config.PretrainConfig) and `python eval.py` (EvalRunConfig) gets its
type, its default and its meaning. The type is the dataclass field's annotation, the meaning the comment written
above the field (or beside it) in the dataclass, and the default the value a plain `python pretrain.py` or
`python eval.py` composes from conf/ (the YAML files of the default groups over the dataclass defaults). The
choices of each Hydra group (conf/<group>/*.yaml) come with the first sentence of their file's leading comment.
A field without a comment, or a YAML file without one, is an error: the page has a line for everything.

A dataclass met a second time (eval.optim after train.optim, anytime.recipe after eval) is not listed again:
its line names where its keys are and the defaults that differ there.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from cramming.config import CONF_DIR, PretrainConfig, register_configs
from cramming.eval.blimp import BlimpConfig
from cramming.eval.config import EvalConfig, EvalRunConfig

PAGE = CONF_DIR.parent / "docs" / "settings.md"
COMMAND = "python -m cramming.settings_reference"
# the Hydra groups each entry point composes, in the order the page lists them (sweep: `+sweep=<name>`)
GROUPS = {
    "pretrain": ("arch", "data", "train", "train/optim", "impl", "sweep"),
    "eval": ("eval", "impl", "sweep"),
}
# launchers are Hydra's own group (hydra/launcher=<name>), listed once
LAUNCHERS = "hydra/launcher"


class UndocumentedError(ValueError):
    """A schema field or a conf/ file without the comment the reference takes its meaning from."""


# ---------------------------------------------------------------------------------------- reading the schemas


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field of a dataclass -> the comment above it (its consecutive comment lines) and beside it, as one
    line. Separator comments (`# --- GaLore ... ---`) head a section, not a field, and are left out."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    docs = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, row = [], node.lineno - 1
        while row >= 1 and lines[row - 1].lstrip().startswith("#"):
            above.insert(0, comments[row])
            row -= 1
        beside = [comments[node.lineno]] if node.lineno in comments else []
        text = " ".join(c for c in above + beside if c and not c.startswith("---"))
        docs[node.target.id] = text
    for base in cls.__mro__[1:]:  # ArchConfig documents nothing itself: its fields are bert.Arch's
        if dataclasses.is_dataclass(base):
            docs = field_docs(base) | {k: v for k, v in docs.items() if v}
    return docs


def class_doc(cls: type) -> str:
    """The first paragraph of a dataclass's own docstring, as one line ("" when it has none: the docstring
    that @dataclass makes up is its signature)."""
    doc = cls.__dict__.get("__doc__") or ""
    if doc.startswith(f"{cls.__name__}("):
        return ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def type_name(kind: Any) -> str:
    """A field's annotation as a reader writes it: `int | null`, `list[str]`, `map of name -> source`."""
    if kind is Any:
        return "any"
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is list:
        return f"list[{type_name(args[0])}]"
    if origin is dict:
        return f"map of name -> {type_name(args[1])}"
    if dataclasses.is_dataclass(kind):
        return kind.__name__
    return getattr(kind, "__name__", str(kind))


def dataclass_of(kind: Any) -> type | None:
    """The dataclass a field holds directly or as the values of a map, else None."""
    if dataclasses.is_dataclass(kind):
        return kind
    if typing.get_origin(kind) is dict and dataclasses.is_dataclass(typing.get_args(kind)[1]):
        return typing.get_args(kind)[1]
    return None


def show(value: Any) -> str:
    """A default as it is written on the command line."""
    if isinstance(value, DictConfig | ListConfig):
        value = OmegaConf.to_container(value, resolve=False)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
    return str(value)


# ------------------------------------------------------------------------------------------------ the rows


@dataclass
class Row:
    key: str
    kind: str
    default: str
    meaning: str


def composed(entry: str) -> DictConfig:
    """The config `python <entry>.py` composes without overrides (eval.py's required checkpoint left missing)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=entry)
    OmegaConf.set_struct(cfg, False)
    cfg.pop("hydra", None)
    return cfg


def node_value(node: DictConfig, key: str) -> Any:
    """The value of `key` as composed, without resolving interpolations (eval.py's name: ${benchmark})."""
    child = node._get_node(key)
    if child is None:
        return None
    if child._is_missing():
        return "??? (required)"
    if child._is_interpolation() or not isinstance(child, DictConfig | ListConfig):
        return child._value()
    return child


def differences(node: DictConfig, first: DictConfig, prefix: str = "") -> list[str]:
    """`key=value` for every leaf of `node` whose value is not that of `first` (the same schema)."""
    found = []
    for key in node:
        here, there = node_value(node, key), node_value(first, key) if key in first else None
        if isinstance(here, DictConfig) and isinstance(there, DictConfig):
            found += differences(here, there, f"{prefix}{key}.")
        elif show(here) != show(there):
            found.append(f"{prefix}{key}={show(here)}")
    return found


def field_default(f: dataclasses.Field) -> Any:
    """A field's dataclass default (for the entries of a map, which no YAML file fills)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


@dataclass
class Place:
    """Where a dataclass's keys are listed: its key, its composed defaults, and whether the rows are written yet
    (eval.py's groups are placed at their own keys before pretrain.py's anytime.* meets them)."""

    key: str
    node: DictConfig | None
    listed: bool = False


def rows_of(cls: type, node: DictConfig | None, prefix: str, places: dict[type, Place]) -> list[Row]:
    """The rows of one dataclass's fields at `prefix`, its nested dataclasses after its own fields. Without a
    composed `node` (an entry of a map) the defaults are the dataclass's own."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        key, kind = f"{prefix}{f.name}", hints[f.name]
        inner = dataclass_of(kind)
        doc = docs.get(f.name) or (class_doc(inner) if inner is not None else "")
        if not doc:
            raise UndocumentedError(
                f"{cls.__module__}.{cls.__qualname__}.{f.name} has no comment: write one line above the field"
                " saying what it does (the settings reference shows it)"
            )
        value = node_value(node, f.name) if node is not None else field_default(f)
        if inner is None:
            rows.append(Row(key, type_name(kind), show(value), doc))
        elif kind is inner:
            nested.append((key, inner, value if isinstance(value, DictConfig) else None, doc))
        else:  # a map of name -> dataclass: the keys of any entry, then what the default entries set
            entries = value if isinstance(value, DictConfig) else {}
            rows.append(Row(key, type_name(kind), ", ".join(entries) or "none", doc))
            nested.append((f"{key}.<name>", inner, None, doc))
            nested += [
                (f"{key}.{name}", inner, entry, f"the default entry {name}")
                for name, entry in entries.items()
            ]
    for key, inner, value, doc in nested:
        rows += nested_rows(key, inner, value, doc, places)
    return rows


def nested_rows(
    key: str, cls: type, node: DictConfig | None, doc: str, places: dict[type, Place]
) -> list[Row]:
    """A nested dataclass's rows at its place (where it is met first, unless placed before), else one row that
    points there and names the defaults that differ from the place's."""
    place = places.setdefault(cls, Place(key, node))
    if place.key == key and not place.listed:
        place.listed = True
        return rows_of(cls, node, f"{key}.", places)
    first = place.node if place.node is not None else OmegaConf.structured(cls)
    differ = differences(node, first) if node is not None else []
    where = "under `python pretrain.py`" if place.key == key else f"of `{place.key}.*`"
    note = f"the keys {where}" + (f"; defaults that differ: {', '.join(differ)}" if differ else "")
    return [Row(f"{key}.*", cls.__name__, "", f"{doc} ({note})")]


# ------------------------------------------------------------------------------------------------ the groups


def yaml_summary(path: Path) -> str:
    """The first sentence of a conf/ file's leading comment (after `# @package ...`)."""
    words = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line[1:]
        if text.strip().startswith("@package"):
            continue
        if text.startswith("   ") or not text.strip():  # an indented example starts: the prose has ended
            break
        words.append(text.strip())
    sentence = re.split(r"(?<=\.) (?=[A-Z])", " ".join(words), maxsplit=1)[0]
    if not sentence:
        raise UndocumentedError(f"{path} has no leading comment: begin it with a line saying what it is for")
    return sentence


def group_lines(groups: tuple[str, ...], chosen: dict[str, str]) -> list[str]:
    """A table with one row per file of conf/<group>/: the choice, whether it is the default, what it is."""
    lines = ["| choice | default | what it is |", "|---|---|---|"]
    for group in groups:
        for path in sorted((CONF_DIR / group).glob("*.yaml")):
            default = "yes" if path.stem == chosen.get(group) else ""
            lines.append(f"| `{group}={path.stem}` | {default} | {cell(yaml_summary(path))} |")
    return lines


def default_choices(entry: str) -> dict[str, str]:
    """The group choices the entry point's YAML file names in its defaults list."""
    chosen = {}
    for item in OmegaConf.load(CONF_DIR / f"{entry}.yaml").get("defaults", []):
        if isinstance(item, DictConfig):
            chosen.update({str(k): str(v) for k, v in item.items()})
    return chosen


# ------------------------------------------------------------------------------------------------ the page


def cell(text: str) -> str:
    """Text for a table cell: a `|`, even in code, would end the cell."""
    return text.replace("|", "\\|")


def table(rows: list[Row]) -> list[str]:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for row in rows:
        code = [f"`{text}`" if text else "" for text in (row.key, row.kind, row.default)]
        lines.append("| " + " | ".join(cell(text) for text in [*code, row.meaning]) + " |")
    return lines


def entry_section(entry: str, schema: type, config: DictConfig, places: dict[type, Place]) -> list[str]:
    what = class_doc(schema).split(":", 1)[-1].strip()
    lines = [f"## `python {entry}.py`", "", what[:1].upper() + what[1:], ""]
    lines += ["### Groups", "", *group_lines(GROUPS[entry], default_choices(entry)), ""]
    lines += ["### Keys", "", *table(rows_of(schema, config, "", places)), ""]
    return lines


INTRO = f"""# Settings reference

Every setting of `python pretrain.py` and `python eval.py`: its type, its default (what the command composes
from `conf/` without overrides) and what it does. Override any of them on the command line (`key=value`), pick
a group's file with `group=<choice>` (`+sweep=<name>` for a ready recipe). A misspelled key or a bad value is
refused at start-up, naming the key ([configuration.md](configuration.md)).

This page is written by `{COMMAND}` from the typed schemas: the dataclasses beside the code they configure,
their fields' comments and the YAML files of `conf/`. Do not edit it by hand; after a change to a schema or a
file of `conf/`, run the command again. `tests/test_settings_reference.py` fails while the page is stale.
"""


def render() -> str:
    """The whole page."""
    pretrain, evaluation = composed("pretrain"), composed("eval")
    # eval.py's own groups are listed in full at their own keys; anytime.recipe and anytime.blimp point there
    places = {EvalConfig: Place("eval", evaluation.eval), BlimpConfig: Place("blimp", evaluation.blimp)}
    lines = [INTRO]
    lines += entry_section("pretrain", PretrainConfig, pretrain, places)
    lines += entry_section("eval", EvalRunConfig, evaluation, places)
    lines += ["## Launchers", "", "For multiruns (`-m`) of either entry point:", ""]
    lines += [*group_lines((LAUNCHERS,), {}), ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page is stale, writing nothing")
    parser.add_argument("--out", type=Path, default=PAGE)
    args = parser.parse_args(argv)
    try:
        page = render()
    except UndocumentedError as err:
        print(f"settings_reference: {err}", file=sys.stderr)
        return 2
    if args.check:
        if not args.out.exists() or args.out.read_text() != page:
            print(f"{args.out} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(page)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
