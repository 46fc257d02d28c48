"""`make demo`: the command the Makefile runs composes to the demo recipe (one thread, embedded data, at most five
minutes of budget, the distance bias that lets it learn), and that recipe trains end to end and ends with the
summary a newcomer reads (what was learned, the checkpoint, the next commands)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from cramming.config import CONF_DIR, register_configs, validate

REPO = Path(__file__).resolve().parent.parent


def makefile_demo_overrides() -> list[str]:
    """The arguments of `pretrain.py` in the Makefile's demo target."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    (line,) = re.findall(r"^demo:.*\n\t\$\(PY\) pretrain\.py (.*)$", text, flags=re.MULTILINE)
    return shlex.split(line)


def test_the_makefile_demo_is_the_documented_recipe():
    register_configs()
    overrides = makefile_demo_overrides()
    assert overrides == ["+sweep=demo"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = validate(compose("pretrain", overrides=overrides))
    assert cfg.budget * 60 <= 5  # minutes: the README promises at most five
    assert cfg.data.name == "embedded" and cfg.impl.cpu_threads == 1
    assert cfg.arch.name == "bert-tiny" and cfg.arch.attention_bias == "alibi"
    assert (cfg.train.batch_size, cfg.train.batch_size_ramp, cfg.train.optim.lr) == (16, 0, 2e-3)
    assert "3 minutes" in (REPO / "README.md").read_text()


@pytest.mark.slow
def test_the_demo_recipe_trains_and_ends_with_a_summary(tmp_path):
    """A few updates of exactly the demo's config (only the stopping rule and the folder differ)."""
    command = [
        sys.executable, str(REPO / "pretrain.py"), *makefile_demo_overrides(),
        f"base_dir={tmp_path}", "budget=1", "train.steps=4", "train.lr_schedule=steps-cosine",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    output = done.stdout + done.stderr
    assert "done: bert-tiny pretrained for 4 updates" in output
    assert "learned: masked-word loss" in output and "with each row's words shuffled" in output
    (run,) = (tmp_path / "demo").iterdir()
    assert f"checkpoint: {run / 'checkpoint'}" in output  # outside the working directory: as it is
    assert f"python eval.py checkpoint=demo base_dir={tmp_path} eval=glue-small" in output
    assert (
        f"python scripts/export_hf.py demo exported/demo --base-dir {tmp_path}" in output
        and "python pretrain.py budget=24" in output
    )


def test_the_summary_says_in_words_whether_context_is_used():
    from cramming.job.summary import learned

    base = {"loss": 5.0, "mlm_acc": 0.2, "context_loss_real": 5.2, "context_unigram_entropy": 5.2}
    using = "\n".join(learned(base | {"context_loss_shuffled": 7.2, "context_gain": 2.0}, 8192))
    assert "reads the words around a gap: 2.00 nats better" in using and "9.01" in using  # ln 8192
    plateau = "\n".join(learned(base | {"context_loss_shuffled": 5.23, "context_gain": 0.03}, 8192))
    assert "does not use context yet (gain 0.03)" in plateau
    assert learned(None, 8192) == ["learned: not measured (no validation rows in this data)"]


def test_the_checkpoint_is_shown_as_typed_from_the_working_directory(tmp_path, monkeypatch):
    from cramming.job.summary import shown

    monkeypatch.chdir(tmp_path)
    assert shown(tmp_path / "outputs" / "demo" / "checkpoint") == "outputs/demo/checkpoint"
    assert shown(Path("/elsewhere/checkpoint")) == "/elsewhere/checkpoint"


def test_the_summary_proposes_the_glue_recipe_for_the_models_width():
    """GLUE-sane's rate is tuned for BERT-base's width: the real run's crammed-bert is pointed at it, the demo's
    bert-tiny at glue-small (the real run's summary used to propose glue-small too)."""
    from cramming.job.summary import next_commands

    assert "eval=glue-small" in next_commands("demo", "outputs", Path("x"), hidden_size=128)[1]
    assert "eval=glue-sane" in next_commands("default", "outputs", Path("x"), hidden_size=768)[1]
