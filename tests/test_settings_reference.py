"""docs/settings.md is what the schemas give, and it lists every key of both entry points."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest
from omegaconf import DictConfig

from cramming import settings_reference as ref

REPO = ref.CONF_DIR.parent


@pytest.fixture(scope="module")
def page() -> str:
    return ref.render()


def test_the_page_is_what_the_schemas_give(page):
    assert (REPO / "docs" / "settings.md").read_text() == page, (
        f"docs/settings.md is stale: run `{ref.COMMAND}` (a schema field, its comment or a conf/ file changed)"
    )


def leaf_keys(node: DictConfig, prefix: str = "") -> list[str]:
    keys = []
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            keys += leaf_keys(child, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


@pytest.mark.parametrize("entry", ["pretrain", "eval"])
def test_every_key_an_entry_point_composes_has_a_row(entry, page):
    listed = set(re.findall(r"^\| `([^`]+)` \|", page, flags=re.M))
    pointers = [key[:-1] for key in listed if key.endswith(".*")]  # a row `eval.optim.*` stands for its keys
    missing = [
        key
        for key in leaf_keys(ref.composed(entry))
        if key not in listed and not any(key.startswith(p) for p in pointers)
    ]
    assert not missing, f"keys of python {entry}.py without a row in the reference: {missing}"
    assert f"## `python {entry}.py`" in page


def test_the_groups_and_their_defaults_are_listed(page):
    for choice in (
        "arch=crammed-bert",
        "data=fineweb-edu",
        "train/optim=adamw_8bit",
        "eval=blimp",
        "sweep=demo",
    ):
        assert f"| `{choice}` |" in page, choice
    assert re.search(r"\| `data=wikibooks` \| yes \|", page) and re.search(
        r"\| `eval=glue-sane` \| yes \|", page
    )


def test_a_field_without_a_comment_is_refused():
    @dataclass
    class Undocumented:
        # documented
        kept: int = 1
        bare: int = 2

    with pytest.raises(ref.UndocumentedError, match=r"Undocumented\.bare has no comment"):
        ref.rows_of(Undocumented, None, "x.", {})


def test_field_docs_take_the_comment_above_and_beside():
    @dataclass
    class Documented:
        # --- a section heading, not a field's doc ---
        # first line
        # second line
        above: int = 1
        beside: str = "b"  # beside it
        nested: list[int] = field(default_factory=list)  # a list

    assert ref.field_docs(Documented) == {
        "above": "first line second line",
        "beside": "beside it",
        "nested": "a list",
    }
    rows = ref.rows_of(Documented, None, "d.", {})
    assert [(r.key, r.kind, r.default) for r in rows] == [
        ("d.above", "int", "1"),
        ("d.beside", "str", "b"),
        ("d.nested", "list[int]", "[]"),
    ]


def test_check_exits_1_on_a_stale_page_and_0_on_a_current_one(tmp_path, capsys, monkeypatch, page):
    monkeypatch.setattr(ref, "render", lambda: page)  # composed once for the module
    out = tmp_path / "settings.md"
    out.write_text("old\n")
    assert ref.main(["--check", "--out", str(out)]) == 1
    assert ref.COMMAND in capsys.readouterr().err
    assert ref.main(["--out", str(out)]) == 0
    assert ref.main(["--check", "--out", str(out)]) == 0
