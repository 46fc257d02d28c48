"""The command line before Hydra reads it (optimizer shorthands) and the hints after it refuses a key."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from cramming.config import CONF_DIR, register_configs
from cramming.errors import ConfigError
from cramming.job import commandline
from cramming.optim import OPTIMIZERS


def test_train_optim_name_becomes_the_config_group():
    argv = ["train.optim=adamw_8bit", "budget=1", "train.optim.lr=1e-3"]
    assert commandline.rewrite_shorthands(argv) == [
        "train/optim=adamw_8bit",
        "budget=1",
        "train.optim.lr=1e-3",
    ]


def test_eval_optim_name_sets_its_name_and_a_sweep_keeps_its_list():
    assert commandline.rewrite_shorthands(["eval.optim=galore_adamw"]) == ["eval.optim.name=galore_adamw"]
    assert commandline.rewrite_shorthands(["train.optim=adamw,adamw_8bit"]) == [
        "train/optim=adamw,adamw_8bit"
    ]


def test_every_optimizer_has_its_group_file():
    """The shorthand relies on conf/train/optim/<name>.yaml existing for each registered name."""
    assert {p.stem for p in (CONF_DIR / "train" / "optim").glob("*.yaml")} == set(OPTIMIZERS)


def test_an_unknown_optimizer_name_is_refused_with_the_choices():
    with pytest.raises(
        ConfigError, match=r"'adam9' is no optimizer; choose one of: adamw.*train/optim=adamw_8bit"
    ):
        commandline.rewrite_shorthands(["train.optim=adam9"])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("arch.num_head=3", "arch.num_heads"),
        ("arch.num_attention_heads=3", "arch.num_heads"),
        ("train.batchsize=8", "train.batch_size"),
        ("impl.devise=cpu", "impl.device"),
    ],
)
def test_an_unknown_key_names_the_closest_valid_keys(override, expected):
    register_configs()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"), pytest.raises(Exception) as caught:
        compose("pretrain", overrides=[override])
    message = commandline.explain(caught.value)
    hint = message.splitlines()[-1]
    assert hint.startswith("did you mean: ") and hint.split(": ", 1)[1].split(", ")[0].rstrip("?") == expected


def test_closest_leaves_out_what_shares_nothing():
    assert commandline.closest("zzz", ["num_heads", "hidden_size"]) == []
