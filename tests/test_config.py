"""Config composition and validation: wrong keys and values fail at start-up, naming the key."""

from __future__ import annotations

import re

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from cramming.config import CONF_DIR, PretrainConfig, arch_preset, register_configs, validate
from cramming.errors import ConfigError

register_configs()


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("pretrain", overrides=list(overrides))


def test_default_config_is_the_cramming_recipe():
    cfg = validate(_compose())
    assert isinstance(cfg, PretrainConfig)
    assert cfg.budget == 24
    assert cfg.data.name == "wikibooks"
    assert cfg.data.seq_length == 128
    assert cfg.data.tokenizer.vocab_size == 32768


@pytest.mark.parametrize("data", ["embedded", "wikibooks", "fineweb-edu"])
def test_every_data_config_validates(data):
    cfg = validate(_compose(f"data={data}"))
    assert cfg.data.name == data


def test_local_data_with_files_validates():
    cfg = validate(_compose("data=local", "data.sources.local.files=/tmp/*.jsonl"))
    assert cfg.data.sources["local"].files == "/tmp/*.jsonl"


def test_unknown_key_is_rejected_by_name():
    with pytest.raises((ConfigCompositionException, ConfigKeyError)) as err:
        _compose("data.vocab=123")
    assert "vocab" in str(err.value) + str(err.value.__cause__)


def test_wrong_type_is_rejected_by_name():
    with pytest.raises((ConfigCompositionException, ValidationError)) as err:
        _compose("data.seq_length=long")
    assert "seq_length" in str(err.value) + str(err.value.__cause__)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("data.ordering=sideways", "data.ordering"),
        ("data.tokenizer.kind=sentencepiece", "data.tokenizer.kind"),
        ("data.seq_length=4", "data.seq_length"),
        ("data.validation_fraction=0.9", "data.validation_fraction"),
        ("data.sources.wikipedia.kind=ftp", "data.sources.wikipedia.kind"),
        ("budget=0", "budget"),
        ("impl.precision=fp8", "impl.precision"),
    ],
)
def test_bad_value_names_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        validate(_compose(override))
    assert f"`{key}`" in str(err.value)


def test_local_source_without_files_says_how_to_fix():
    with pytest.raises(ConfigError) as err:
        validate(_compose("data=local"))
    assert "data.sources.local.files" in str(err.value)


def test_run_directory_is_predictable():
    from hydra import compose as hydra_compose

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose("pretrain", overrides=["name=myrun", "base_dir=/runs"], return_hydra_config=True)
    assert cfg.hydra.run.dir.startswith("/runs/myrun/")


def test_cpu_study_sweep_composes_to_its_documented_recipe():
    # results/cpu-study/'s one-line command: the sweep file must give exactly these settings
    cfg = validate(_compose("+sweep=cpu-study", "arch=bert-tiny", "budget=1"))
    assert cfg.arch.name == "bert-tiny" and cfg.arch.attention_bias == "alibi"
    assert cfg.data.tokenizer.vocab_size == 8192
    # all twelve shards, in the project-local folder that `scripts/get_data.py wikipedia` makes
    assert cfg.data.sources["local"].files == "data/wikipedia/train-*-of-00012.jsonl.gz"
    assert (cfg.train.batch_size, cfg.train.batch_size_ramp, cfg.impl.cpu_threads) == (64, 0, 1)
    mini = validate(_compose("+sweep=cpu-study", "arch=bert-mini"))
    assert mini.arch.name == "bert-mini" and mini.arch.attention_bias == "alibi"
    small = validate(_compose("+sweep=cpu-study", "arch=bert-small"))
    assert small.arch.name == "bert-small" and small.arch.hidden_size == 512
    assert small.arch.attention_bias == "alibi"


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (CONF_DIR / "eval").glob("*.yaml")))
def test_every_eval_recipe_validates(recipe):
    from cramming.eval.config import EvalRunConfig

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = validate(compose("eval", overrides=["checkpoint=x", f"eval={recipe}"]), EvalRunConfig)
    if recipe == "blimp":  # the zero-shot benchmark: its own settings, and its own run name
        assert cfg.benchmark == "blimp" and cfg.name == "blimp" and cfg.blimp.variant == "within_word_l2r"
        return
    assert cfg.benchmark == "glue" and cfg.name == "glue" and cfg.eval.name == recipe
    if recipe == "glue-small":
        assert (
            cfg.eval.group_by_length and cfg.eval.optim.lr == 1e-3 and cfg.eval.per_task["SST-2"].epochs == 1
        )
        assert cfg.eval.head.pooler == "pair" and cfg.eval.head.dim == 1024  # glue-sane's head, pair-pooled


# A path that names one machine's folders: absolute (POSIX or a Windows drive) or in someone's home.
MACHINE_PATH = re.compile(r"^(/|~|[A-Za-z]:[\\/])")
MACHINE_PATH_IN_TEXT = re.compile(r"(?<![\w.$}])(/(work|home|root|Users|mnt|scratch|data)/|~/)")


def _strings(node, where: str):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _strings(value, f"{where}[{i}]")
    elif isinstance(node, str):
        yield where, node


def test_no_config_names_an_absolute_path():
    """Configs run on any machine: data and outputs are named relative to the repository root (data/, which
    scripts/get_data.py fills), or given on the command line."""
    found = []
    for path in sorted(CONF_DIR.rglob("*.yaml")):
        text = path.read_text()
        tree = yaml.safe_load(text) or {}
        found += [
            f"{path.relative_to(CONF_DIR)}: {key} = {value}"
            for key, value in _strings(tree, "")
            if MACHINE_PATH.match(value)
        ]
        found += [
            f"{path.relative_to(CONF_DIR)}:{n}: {line.strip()}"
            for n, line in enumerate(text.splitlines(), 1)
            if MACHINE_PATH_IN_TEXT.search(line)
        ]
    assert not found, "absolute paths in conf/:\n" + "\n".join(found)


def test_no_script_or_entry_point_names_a_machines_folder():
    root = CONF_DIR.parent
    scripts = sorted(path for path in (root / "scripts").rglob("*") if path.suffix in (".py", ".sh", ".md"))
    files = [*scripts, root / "pretrain.py", root / "eval.py", root / "Makefile"]
    found = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for path in files
        if path.is_file()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if MACHINE_PATH_IN_TEXT.search(line)
    ]
    assert not found, "a machine's folders named in:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "value, absolute",
    [
        ("/home/me/glue", True),
        ("~/data", True),
        ("C:\\data", True),
        ("data/glue", False),
        ("outputs", False),
    ],
)
def test_the_absolute_path_check_can_fail(value, absolute):
    assert bool(MACHINE_PATH.match(value)) == absolute
    assert bool(MACHINE_PATH_IN_TEXT.search(f"files: {value}")) == (absolute and not value.startswith("C:"))


def test_an_arch_preset_is_read_with_overrides_and_checked_like_a_runs():
    arch = arch_preset("bert-tiny", ["num_layers=4", "attention_bias=alibi"])
    assert arch.name == "bert-tiny" and arch.num_layers == 4 and arch.attention_bias == "alibi"
    with pytest.raises(ConfigError, match="num_layer"):
        arch_preset("bert-tiny", ["num_layer=4"])
    with pytest.raises(ConfigError, match="bert-tiny"):  # the presets there are named
        arch_preset("bert-tinny")


def test_a_micro_batch_that_does_not_divide_the_batch_is_refused_naming_the_nearest_that_does():
    from cramming.train.autobatch import check_batch_division

    with pytest.raises(ConfigError, match=r"impl.microbatch_size=128 \(the nearest that divides it\) or 64"):
        check_batch_division(8192, 100)
    with pytest.raises(ConfigError, match=r"impl.microbatch_size=64 \(the nearest that divides it\) or 128"):
        check_batch_division(8192, 96)  # a tie: the smaller, which fits in less memory
    with pytest.raises(ConfigError, match=r"impl.microbatch_size=4$"):
        check_batch_division(4, 8)  # nothing larger divides 4
