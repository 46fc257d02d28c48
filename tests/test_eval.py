"""GLUE fine-tuning end to end on a tiny model: every optimizer family learns, skipped tasks, lookup by name."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import data_dir

from cramming.data.config import NormalizerConfig, TokenizerConfig
from cramming.data.tokenizer import SpecialTokens, build_normalizer, train_tokenizer
from cramming.errors import ConfigError, DataSourceError
from cramming.eval.backbone import Backbone
from cramming.eval.config import EvalConfig, EvalRunConfig
from cramming.eval.finetune import EvaluationStopped, finetune
from cramming.eval.glue_data import load_local
from cramming.eval.run import (
    RESULTS_JSON,
    RESULTS_TABLE,
    RUNS_JSON,
    checkpoint_backbone,
    load_tasks,
    recipe_of,
    run_glue,
)
from cramming.eval.tasks import GLUE_TASKS
from cramming.impl import ImplConfig
from cramming.job.cluster import SUBMITIT_ENV
from cramming.model import ArchConfig, build_model
from cramming.model.checkpoint import resolve_checkpoint, save_pretrained
from cramming.optim.schedules import LR_SCHEDULES, step_progress
from cramming.utils import flatten

TINY = ArchConfig(name="tiny", num_layers=2, hidden_size=64, num_heads=2, intermediate_size=128, dropout=0.0)


def _save_tiny_checkpoint(run_dir, texts):
    norm_cfg = NormalizerConfig()
    norm = build_normalizer(norm_cfg)
    tokenizer = train_tokenizer(
        [[norm.normalize_str(t) for t in texts]], TokenizerConfig(vocab_size=1500), norm_cfg
    )
    torch.manual_seed(0)  # the same untrained weights whatever ran before (the tests compare against chance)
    model = build_model(TINY, tokenizer.get_vocab_size())
    return save_pretrained(
        model,
        run_dir / "checkpoint",
        tokenizer,
        seq_length=128,
        special=SpecialTokens(),
        info={"note": "untrained"},
    )


@pytest.fixture(scope="module")
def sst2(tmp_path_factory):
    splits = load_local(GLUE_TASKS["SST-2"], data_dir("glue"))
    subset = splits["train"].shuffle(seed=0).select(range(160))
    root = tmp_path_factory.mktemp("runs")
    checkpoint = _save_tiny_checkpoint(
        root / "tiny" / "2026-01-01_00-00-00", splits["train"]["text_a"][:5000]
    )
    return subset, checkpoint


@pytest.mark.parametrize(
    "optim",
    ["adamw", "adamw_8bit", "galore_adamw", "galore_adamw_8bit", "galore_adafactor", "adamw_layerwise"],
)
def test_every_optimizer_family_fits_the_training_subset(sst2, optim):
    """A tiny model fine-tuned on 160 SST-2 sentences beats the majority class on those sentences."""
    subset, checkpoint = sst2
    # GaLore's scale ~ sqrt(width / rank) = sqrt(64 / 8): its update then has AdamW's norm
    # (results/optimizers/); at scale 1 it moves a third as far and may not leave chance in 80 updates
    settings = replace(EvalConfig().optim, name=optim, lr=2e-3, rank=8, scale=3.0, update_proj_gap=50)
    cfg = EvalConfig(tasks=["SST-2"], optim=settings, epochs=8, batch_size=16)
    splits = {"train": subset, "dev": subset}  # evaluated on what it was trained on: can it learn at all
    impl = ImplConfig(device="cpu")
    result = finetune(GLUE_TASKS["SST-2"], splits, checkpoint_backbone(checkpoint, impl), cfg, impl, seed=0)
    labels = np.asarray(subset["label"])
    majority = max(labels.mean(), 1 - labels.mean())
    accuracy = result.metrics["SST-2"]["accuracy"]
    assert accuracy > majority + 0.1, f"{optim}: accuracy {accuracy:.3f}, majority class {majority:.3f}"
    assert result.steps == 8 * 10
    # the run records what it measured: state from the optimizer's tensors, peak memory, training time
    full_state = optim in ("adamw", "adamw_layerwise")  # two fp32 moments per parameter
    ratio = result.optimizer_state_ratio_to_adamw
    assert ratio == 1.0 if full_state else 0 < ratio < 1, f"{optim}: state {ratio} of AdamW's"
    assert result.optimizer_state_bytes > 0 and result.peak_memory_bytes > 0
    assert 0 < result.train_seconds <= result.seconds


def partial_glue(tmp_path: Path, glue_dir: Path, tasks=("RTE", "STS-B")) -> Path:
    """A GLUE folder with only `tasks` (links to the real copy)."""
    partial = tmp_path / "glue"
    partial.mkdir()
    for task in tasks:
        (partial / task).symlink_to(glue_dir / task)
    return partial


def small_eval(glue: Path, **changes) -> EvalConfig:
    return EvalConfig(
        glue_dir=str(glue), epochs=1, max_train_examples=48, max_eval_examples=40,
        optim=replace(EvalConfig().optim, lr=1e-3), **changes,
    )  # fmt: skip


def test_run_glue_writes_tables_and_skips_missing_tasks_of_the_default_list(sst2, tmp_path, glue_dir):
    _, checkpoint = sst2
    cfg = EvalRunConfig(
        eval=small_eval(partial_glue(tmp_path, glue_dir)),  # the default eight tasks, two of them there
        impl=ImplConfig(device="cpu"),
        checkpoint=str(checkpoint),
    )
    assert not cfg.eval.tasks_named
    report = run_glue(cfg, checkpoint_backbone(checkpoint, cfg.impl), tmp_path)
    assert report["skipped_no_data"] == ["CoLA", "SST-2", "MRPC", "QQP", "MNLI", "QNLI"]
    assert set(report["scores"]) == {"RTE", "STS-B"}
    assert report["scores"]["STS-B"]["metric"] == "pearson"
    assert report["average_entries"] == ["STS-B", "RTE"]
    assert json.loads((tmp_path / RESULTS_JSON).read_text())["glue_average"] == pytest.approx(
        report["glue_average"]
    )
    table = (tmp_path / RESULTS_TABLE).read_text()
    assert "| STS-B | RTE | Avg |" in table and "Skipped (no data): CoLA, SST-2, MRPC, QQP" in table


def test_a_named_task_without_data_fails_before_any_finetuning(sst2, tmp_path, glue_dir):
    _, checkpoint = sst2
    cfg = EvalRunConfig(
        eval=small_eval(partial_glue(tmp_path, glue_dir), tasks=["RTE", "QQP"]),
        impl=ImplConfig(device="cpu"),
        checkpoint=str(checkpoint),
    )
    with pytest.raises(DataSourceError, match=r"QQP: missing .*eval.tasks=RTE,QQP.*eval.tasks=\[RTE\]"):
        run_glue(cfg, checkpoint_backbone(checkpoint, cfg.impl), tmp_path / "out")
    assert not (tmp_path / "out" / RESULTS_JSON).exists()


def test_without_network_a_recipes_tasks_fail_naming_the_local_copy_not_a_task_the_user_named(monkeypatch):
    from cramming.eval import glue_data

    def unreachable(task, cache_dir=None):
        raise ConnectionError("Couldn't reach 'nyu-mll/glue' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(glue_data, "hub_dataset", unreachable)
    recipe = EvalRunConfig(
        eval=EvalConfig(tasks=["CoLA", "SST-2"]), checkpoint="demo"
    )  # eval=glue-small's kind
    with pytest.raises(DataSourceError) as raised:
        load_tasks(recipe)
    message = str(raised.value)
    assert "could not reach the Hugging Face hub" in message and "get_data.py glue" in message
    assert "eval.glue_dir" in message and "names" not in message and "leave" not in message


def test_a_glue_dir_that_does_not_exist_fails_at_start_up():
    with pytest.raises(ConfigError, match="eval.glue_dir.*no such folder"):
        EvalConfig(glue_dir="/nonexistent/glue", tasks=["RTE"])


def test_bad_rows_fail_unless_skipped_and_then_are_counted(sst2, tmp_path, glue_dir):
    _, checkpoint = sst2
    glue = tmp_path / "glue" / "RTE"
    glue.mkdir(parents=True)
    (glue / "dev.tsv").symlink_to(glue_dir / "RTE" / "dev.tsv")
    lines = (glue_dir / "RTE" / "train.tsv").read_text().splitlines()[:61]
    lines[5] = "5\tonly one sentence"  # a missing field
    lines[9] = lines[9].rsplit("\t", 1)[0] + "\tmaybe"  # a label outside the task's
    (glue / "train.tsv").write_text("\n".join(lines) + "\n")
    cfg = EvalRunConfig(eval=small_eval(glue.parent, tasks=["RTE"]), impl=ImplConfig(device="cpu"),
                        checkpoint=str(checkpoint))  # fmt: skip
    with pytest.raises(
        DataSourceError, match=r"train.tsv:6 has 2 fields, expected 4: .*eval.skip_bad_rows=true"
    ):
        run_glue(cfg, checkpoint_backbone(checkpoint, cfg.impl), tmp_path / "strict")
    cfg.eval.skip_bad_rows = True
    report = run_glue(cfg, checkpoint_backbone(checkpoint, cfg.impl), tmp_path / "lenient")
    assert report["bad_rows_skipped"] == {"RTE": 2} and set(report["scores"]) == {"RTE"}
    assert json.loads((tmp_path / "lenient" / RESULTS_JSON).read_text())["bad_rows_skipped"] == {"RTE": 2}
    assert (
        "Bad rows skipped (eval.skip_bad_rows): RTE 2." in (tmp_path / "lenient" / RESULTS_TABLE).read_text()
    )


@pytest.mark.slow
def test_eval_py_fails_with_exit_2_and_a_failed_card_when_a_named_task_has_no_data(sst2, tmp_path):
    import subprocess
    import sys

    _, checkpoint = sst2
    done = subprocess.run(
        [sys.executable, "eval.py", f"checkpoint={checkpoint}", f"base_dir={tmp_path}", "impl.device=cpu",
         f"eval.glue_dir={tmp_path}", "eval.tasks=[RTE]"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]
    assert f"RTE: missing {tmp_path / 'RTE' / 'train.tsv'}" in output
    (card,) = tmp_path.glob("glue/*/run_card.json")
    card = json.loads(card.read_text())
    assert card["status"] == "failed" and "get_data.py glue --tasks RTE" in card["error"]


def test_eval_budget_stops_before_later_tasks(sst2, tmp_path, glue_dir):
    _, checkpoint = sst2
    ticks = iter(range(0, 10**6, 3600))  # every look at the clock is one more hour
    cfg = EvalRunConfig(
        eval=EvalConfig(
            tasks=["RTE", "MRPC"],
            glue_dir=str(glue_dir),
            epochs=1,
            max_train_examples=32,
            max_eval_examples=16,
        ),
        impl=ImplConfig(device="cpu"),
        checkpoint=str(checkpoint),
        budget=1.5,
    )
    backbone = checkpoint_backbone(checkpoint, cfg.impl)
    report = run_glue(cfg, backbone, tmp_path, clock=lambda: float(next(ticks)))
    assert report["not_run_budget"] == ["MRPC"]
    assert report["runs"][0]["stopped_by_budget"]
    assert "Not run (the eval budget ran out first): MRPC." in (tmp_path / RESULTS_TABLE).read_text()


def test_checkpoint_lookup_by_name_and_path(sst2, tmp_path):
    _, checkpoint = sst2
    base = checkpoint.parent.parent.parent  # {base}/tiny/{timestamp}/checkpoint
    newer = base / "tiny" / "2026-02-01_00-00-00"
    _save_tiny_checkpoint(newer, ["a few words of text to train on", "and some more words"] * 20)
    assert resolve_checkpoint("tiny", base) == newer / "checkpoint"
    assert resolve_checkpoint(str(checkpoint.parent), base) == checkpoint
    assert resolve_checkpoint(str(checkpoint), base) == checkpoint
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*nor a finished run named 'other'"):
        resolve_checkpoint("other", base)


def test_schedule_warms_up_then_decays():
    total = 100
    # fine-tuning's schedule comes from the one registry (steps-cosine), counting the update being applied
    schedule = LR_SCHEDULES[EvalConfig().schedule]
    factors = [schedule.factor(step_progress(s, total), 0.1) for s in range(total)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    # the decay starts right after the warm-up (before the registry: one step later)
    assert factors[10] == pytest.approx(1.0, abs=1e-3) and factors[-1] < 0.01
    assert all(a >= b for a, b in zip(factors[10:], factors[11:], strict=False))


def test_glue_head_is_crammings_by_default_and_the_bare_linear_one_is_selectable():
    from cramming.eval.config import HeadConfig
    from cramming.eval.head import SequenceClassifier

    encoder = torch.nn.Embedding(50, 16)  # a stand-in encoder: (ids, mask, types) -> (batch, seq, 16)

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = encoder

        def forward(self, ids, mask, types=None):
            return self.embed(ids)

    default = SequenceClassifier(Encoder(), 16, 3, dropout=0.1, head=HeadConfig())
    assert default.dense.out_features == 1024 and isinstance(default.nonlinearity, torch.nn.Tanh)
    assert default.head.in_features == 1024 and torch.all(default.head.bias == 0)
    assert default.head.weight.std().item() == pytest.approx(0.02, rel=0.1)  # 3072 draws: 10% is 4 sigma
    bare = SequenceClassifier(Encoder(), 16, 3, dropout=0.1, head=HeadConfig(dim=0))
    assert bare.dense is None and bare.head.in_features == 16
    # mean pooling reads the real tokens only: padding changes nothing
    mean = SequenceClassifier(Encoder(), 16, 2, dropout=0.0, head=HeadConfig(pooler="mean")).eval()
    ids, mask = torch.tensor([[3, 4, 5, 0, 0]]), torch.tensor([[1, 1, 1, 0, 0]])
    torch.testing.assert_close(mean(ids, mask), mean(ids[:, :3], mask[:, :3]), rtol=1e-6, atol=1e-6)
    with pytest.raises(ConfigError, match="eval.head.pooler"):
        EvalConfig(head=HeadConfig(pooler="max"))


@pytest.mark.slow
def test_fine_tuning_in_bf16_autocast_on_cpu(sst2):
    """The GPU's autocast path, exercised on the CPU: fine-tuning in bf16 still fits the training subset."""
    subset, checkpoint = sst2
    cfg = EvalConfig(tasks=["SST-2"], optim=replace(EvalConfig().optim, lr=2e-3), epochs=8, batch_size=16)
    impl = ImplConfig(device="cpu", precision="bf16")
    splits = {"train": subset, "dev": subset}
    result = finetune(GLUE_TASKS["SST-2"], splits, checkpoint_backbone(checkpoint, impl), cfg, impl, seed=0)
    labels = np.asarray(subset["label"])
    assert result.metrics["SST-2"]["accuracy"] > max(labels.mean(), 1 - labels.mean()) + 0.1
    assert len(result.epoch_losses) == 8 and result.epoch_losses[-1] < result.epoch_losses[0]  # it fits


def test_length_grouped_epoch_is_a_permutation_of_batches_of_similar_length():
    from cramming.eval.finetune import Encoded, epoch_order

    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 60, size=1000)
    train = Encoded(
        ids=[[1] * n for n in lengths], type_ids=[[0] * n for n in lengths], labels=np.zeros(1000)
    )
    plain = epoch_order(train, 16, np.random.default_rng(1), group_by_length=False)
    grouped = epoch_order(train, 16, np.random.default_rng(1), group_by_length=True)
    assert sorted(grouped.tolist()) == list(range(1000))  # every example once
    batches = [grouped[i : i + 16] for i in range(0, 1000, 16)]

    def padded(order):  # tokens after padding each batch of 16 to its longest
        return sum(
            lengths[order[i : i + 16]].max() * len(order[i : i + 16]) for i in range(0, len(order), 16)
        )

    assert padded(grouped) < 0.75 * padded(plain)
    # the batches come from random places: consecutive batches are not sorted by length end to end
    firsts = [lengths[b].max() for b in batches[:-1]]
    assert firsts != sorted(firsts, reverse=True)
    # a different seed draws different batches
    again = epoch_order(train, 16, np.random.default_rng(2), group_by_length=True)
    assert not np.array_equal(again, grouped)


def test_an_interrupted_evaluation_keeps_its_finished_runs_and_resume_takes_them_up(
    sst2, tmp_path, glue_dir, monkeypatch
):
    """Each finished (task, seed) is on disk at once; resume=true fine-tunes only what is missing and reports
    the earlier run's scores unchanged."""
    import cramming.eval.finetune as finetuning

    _, checkpoint = sst2
    real, tuned = finetuning.finetune, []

    def interrupted_on_sts_b(task, *args, **kwargs):
        tuned.append(task.name)
        if task.name == "STS-B":
            raise KeyboardInterrupt  # the user stops the evaluation during its second task
        return real(task, *args, **kwargs)

    monkeypatch.setattr(finetuning, "finetune", interrupted_on_sts_b)
    cfg = EvalRunConfig(
        eval=small_eval(glue_dir, tasks=["RTE", "STS-B"]),
        impl=ImplConfig(device="cpu"),
        checkpoint=str(checkpoint),
        base_dir=str(tmp_path),
        name="glue-x",
    )
    backbone = checkpoint_backbone(checkpoint, cfg.impl)
    first = tmp_path / "glue-x" / "2026-01-01_00-00-00"
    with pytest.raises(KeyboardInterrupt):
        run_glue(cfg, backbone, first)
    kept = json.loads((first / RUNS_JSON).read_text())["runs"]
    assert [(run["task"], run["seed"]) for run in kept] == [("RTE", 0)]
    assert not (first / RESULTS_JSON).exists()

    def counted(task, *args, **kwargs):
        tuned.append(task.name)
        return real(task, *args, **kwargs)

    monkeypatch.setattr(finetuning, "finetune", counted)
    tuned.clear()
    second = tmp_path / "glue-x" / "2026-01-01_00-10-00"
    report = run_glue(replace(cfg, resume=True), backbone, second)
    assert tuned == ["STS-B"]
    assert report["reused_runs"] == 1
    assert report["runs"][0]["metrics"] == kept[0]["metrics"]
    assert report["runs"][0]["reused_from"] == str(first)
    assert set(report["scores"]) == {"RTE", "STS-B"}
    assert len(json.loads((second / RUNS_JSON).read_text())["runs"]) == 2  # a later resume finds both
    assert "Reused (resume=true): 1 of 2 runs" in (second / RESULTS_TABLE).read_text()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGUSR2])
def test_a_stop_signal_ends_fine_tuning_after_an_update_and_keeps_the_finished_runs(
    sst2, tmp_path, glue_dir, monkeypatch, signum
):
    """The signal is noted, acted on after the next update (not wherever it lands: a finalizer would swallow
    the exit), the run under way is dropped, the finished ones stay on disk, and the handlers are restored."""
    import cramming.eval.finetune as finetuning

    _, checkpoint = sst2
    real, started, updates = finetuning.finetune, [], []

    def signalled_in_the_second_run(task, *args, **kwargs):
        started.append((task.name, args[4]))  # (task, seed)
        if len(started) == 2:
            os.kill(os.getpid(), signum)  # lands before the run's first update
        result = real(task, *args, **kwargs)
        updates.append(result.steps)
        return result

    monkeypatch.setattr(finetuning, "finetune", signalled_in_the_second_run)
    monkeypatch.delenv(SUBMITIT_ENV, raising=False)  # a plain run: nothing to hand the signal back to
    cfg = EvalRunConfig(
        eval=small_eval(glue_dir, tasks=["RTE"], seeds=[0, 1, 2]),
        impl=ImplConfig(device="cpu"),
        checkpoint=str(checkpoint),
        base_dir=str(tmp_path),
        name="glue-s",
    )
    previous = signal.getsignal(signum)
    with pytest.raises(EvaluationStopped) as stopped:
        run_glue(cfg, checkpoint_backbone(checkpoint, cfg.impl), tmp_path / "run")
    assert stopped.value.signal_name == signal.Signals(signum).name
    assert signal.getsignal(signum) is previous
    assert len(started) == 2 and len(updates) == 1  # the second run raised during its first epoch
    kept = json.loads((tmp_path / "run" / RUNS_JSON).read_text())["runs"]
    assert [(run["task"], run["seed"]) for run in kept] == [started[0]]
    assert not (tmp_path / "run" / RESULTS_JSON).exists()


def resuming_rte(sst2, tmp_path: Path, glue_dir: str, name: str) -> tuple[EvalRunConfig, Backbone]:
    """An RTE evaluation of the sst2 fixture's checkpoint under `name`, with resume=true, and its backbone."""
    _, checkpoint = sst2
    cfg = EvalRunConfig(
        eval=small_eval(glue_dir, tasks=["RTE"]),
        impl=ImplConfig(device="cpu"),
        checkpoint=str(checkpoint),
        base_dir=str(tmp_path),
        name=name,
        resume=True,
    )
    return cfg, checkpoint_backbone(checkpoint, cfg.impl)


def test_resume_refuses_another_recipe_and_reruns_what_the_budget_cut_short(
    sst2, tmp_path, glue_dir, monkeypatch
):
    import cramming.eval.finetune as finetuning
    from cramming.eval.finetune import TaskResult

    cfg, backbone = resuming_rte(sst2, tmp_path, glue_dir, "glue-y")
    here = tmp_path / "glue-y" / "2026-01-01_00-10-00"
    with pytest.raises(ConfigError, match="no earlier evaluation named 'glue-y'.*drop resume=true"):
        run_glue(cfg, backbone, here)

    earlier = tmp_path / "glue-y" / "2026-01-01_00-00-00"
    earlier.mkdir(parents=True)
    cut = {"task": "RTE", "seed": 0, "metrics": {"RTE": {"accuracy": 0.5}}, "train_examples": 48, "steps": 1,
           "seconds": 1.0, "final_loss": 0.7, "stopped_by_budget": True}  # fmt: skip
    source = str(backbone.info["checkpoint"])
    other = replace(cfg, eval=replace(cfg.eval, optim=replace(cfg.eval.optim, lr=3e-4)))
    (earlier / RUNS_JSON).write_text(json.dumps({"recipe": recipe_of(other, source), "runs": [cut]}))
    with pytest.raises(ConfigError, match=r"eval.optim.lr: 0.0003 there, 0.001 here"):
        run_glue(cfg, backbone, here)

    (earlier / RUNS_JSON).write_text('{"recipe": {')  # not what run_glue writes (it writes atomically)
    with pytest.raises(ConfigError, match=r"does not read as an evaluation's runs.*move it away"):
        run_glue(cfg, backbone, here)

    (earlier / RUNS_JSON).write_text(json.dumps({"recipe": recipe_of(cfg, source), "runs": [cut]}))
    tuned = []

    def fake(task, *args, **kwargs):
        tuned.append(task.name)
        return TaskResult({"RTE": {"accuracy": 0.75}}, 48, 3, 0.1, 0.6, stopped_by_budget=False)

    monkeypatch.setattr(finetuning, "finetune", fake)
    report = run_glue(cfg, backbone, here)
    assert tuned == ["RTE"] and report["reused_runs"] == 0  # a run the budget stopped is not a finished one
    assert report["scores"]["RTE"]["median"] == 0.75


def test_resume_reads_a_setting_added_later_as_what_evaluations_saved_without_it_ran_with(
    sst2, tmp_path, glue_dir, monkeypatch
):
    import cramming.eval.finetune as finetuning
    from cramming.eval.run import ADDED_LATER

    cfg, backbone = resuming_rte(sst2, tmp_path, glue_dir, "glue-z")
    recipe = recipe_of(cfg, str(backbone.info["checkpoint"]))
    assert recipe["eval"]["optim"]["layer_decay"] == 1.0 and recipe["eval"]["dropout"] is None  # all recorded
    old = json.loads(json.dumps(recipe))  # as an evaluation saved before every setting of the table existed
    for key, value in ADDED_LATER.items():
        assert flatten(recipe)[key] == value  # the table's value is today's default, what the key did before
        *parents, leaf = key.split(".")
        node = old
        for part in parents:
            node = node[part]
        del node[leaf]
    assert {"eval.optim.layer_decay", "eval.dropout"} <= ADDED_LATER.keys()
    finished = {"task": "RTE", "seed": 0, "metrics": {"RTE": {"accuracy": 0.5}}, "train_examples": 48,
                "steps": 1, "seconds": 1.0, "final_loss": 0.7, "stopped_by_budget": False}  # fmt: skip
    earlier = tmp_path / "glue-z" / "2026-01-01_00-00-00"
    earlier.mkdir(parents=True)
    (earlier / RUNS_JSON).write_text(json.dumps({"recipe": old, "runs": [finished]}))

    def fake(*args, **kwargs):
        raise AssertionError("a finished run was fine-tuned again")

    monkeypatch.setattr(finetuning, "finetune", fake)
    report = run_glue(cfg, backbone, tmp_path / "glue-z" / "2026-01-01_00-10-00")
    assert report["reused_runs"] == 1 and report["scores"]["RTE"]["median"] == 0.5

    decayed = replace(cfg, eval=replace(cfg.eval, optim=replace(cfg.eval.optim, layer_decay=0.8)))
    with pytest.raises(ConfigError, match=r"eval.optim.layer_decay: 1.0 there, 0.8 here"):
        run_glue(decayed, backbone, tmp_path / "glue-z" / "2026-01-01_00-20-00")


def test_layer_decay_reaches_each_task_and_the_recipe(glue_dir):
    from cramming.eval.finetune import _with_lr

    cfg = EvalRunConfig(eval=small_eval(glue_dir, tasks=["RTE"]), checkpoint="run")
    decayed = replace(cfg, eval=replace(cfg.eval, optim=replace(cfg.eval.optim, layer_decay=0.8)))
    assert recipe_of(decayed, "run")["eval"]["optim"]["layer_decay"] == 0.8
    assert _with_lr(decayed.eval, 3e-4).layer_decay == 0.8  # a task's own rate keeps the decay


def test_eval_dropout_replaces_the_checkpoints_in_the_copy_only_and_enters_the_recipe(sst2, glue_dir):
    from cramming.eval.finetune import fresh_classifier
    from cramming.model.bert import SelfAttention

    _, checkpoint = sst2
    backbone = checkpoint_backbone(checkpoint, ImplConfig(device="cpu"))  # TINY: arch.dropout 0.0

    def rates(module):
        return {m.p for m in module.modules() if isinstance(m, torch.nn.Dropout)} | {
            m.dropout_p for m in module.modules() if isinstance(m, SelfAttention)
        }

    task, cpu = GLUE_TASKS["RTE"], torch.device("cpu")
    assert rates(fresh_classifier(task, backbone, EvalConfig(tasks=["RTE"]), cpu, seed=0)) == {0.0}
    changed = fresh_classifier(task, backbone, EvalConfig(tasks=["RTE"], dropout=0.3), cpu, seed=0)
    assert rates(changed) == {0.3}  # every dropout of encoder and head, attention's included
    assert rates(backbone.encoder) == {0.0}  # the next task's copy starts from the checkpoint again

    cfg = EvalRunConfig(eval=small_eval(glue_dir, tasks=["RTE"]), checkpoint="run")
    assert recipe_of(replace(cfg, eval=replace(cfg.eval, dropout=0.0)), "run")["eval"]["dropout"] == 0.0
    for bad in (1.0, -0.1):
        with pytest.raises(ConfigError, match=r"eval.dropout.*\[0, 1\)"):
            EvalConfig(tasks=["RTE"], dropout=bad)

    class Wrapped(torch.nn.Module):  # an encoder that cannot set its dropout (a transformers model, e.g.)
        def forward(self, ids, mask=None, types=None):
            return torch.zeros(*ids.shape, backbone.hidden_size)

    foreign = replace(backbone, encoder=Wrapped())
    with pytest.raises(ConfigError, match="eval.dropout=0.2: .*Leave eval.dropout null"):
        fresh_classifier(task, foreign, EvalConfig(tasks=["RTE"], dropout=0.2), cpu, seed=0)


def test_a_requeued_evaluation_takes_up_its_own_runs_and_a_multirun_resumes_job_by_job(
    sst2, tmp_path, glue_dir, monkeypatch
):
    """No resume=true is needed where the evaluation's own folder holds finished runs (its launcher started the
    job again in the same folder); resume=true in a multirun continues job N of the newest earlier multirun."""
    import cramming.eval.finetune as finetuning
    from cramming.eval.finetune import TaskResult

    _, checkpoint = sst2
    cfg = EvalRunConfig(
        eval=small_eval(glue_dir, tasks=["RTE"]),
        impl=ImplConfig(device="cpu"),
        checkpoint=str(checkpoint),
        base_dir=str(tmp_path),
        name="glue-z",
    )
    backbone = checkpoint_backbone(checkpoint, cfg.impl)
    source = str(backbone.info["checkpoint"])
    finished = {"task": "RTE", "seed": 0, "metrics": {"RTE": {"accuracy": 0.625}}, "train_examples": 48,
                "steps": 3, "seconds": 1.0, "final_loss": 0.6, "stopped_by_budget": False}  # fmt: skip
    tuned = []

    def fake(task, *args, **kwargs):
        tuned.append(task.name)
        return TaskResult({"RTE": {"accuracy": 0.75}}, 48, 3, 0.1, 0.6, stopped_by_budget=False)

    monkeypatch.setattr(finetuning, "finetune", fake)
    requeued = tmp_path / "glue-z" / "multirun_2026-01-01_00-00-00" / "1"
    requeued.mkdir(parents=True)
    (requeued / RUNS_JSON).write_text(json.dumps({"recipe": recipe_of(cfg, source), "runs": [finished]}))
    report = run_glue(cfg, backbone, requeued, sweep_job=1)
    assert tuned == [] and report["reused_runs"] == 1 and report["scores"]["RTE"]["median"] == 0.625

    # a later multirun with resume=true: its job 1 takes up job 1 of the multirun before, its job 0 has none
    later = tmp_path / "glue-z" / "multirun_2026-01-01_00-10-00"
    report = run_glue(replace(cfg, resume=True), backbone, later / "1", sweep_job=1)
    assert tuned == [] and report["runs"][0]["reused_from"] == str(requeued)
    with pytest.raises(ConfigError, match=r"no earlier evaluation named 'glue-z'.*multirun_\*/0"):
        run_glue(replace(cfg, resume=True), backbone, later / "0", sweep_job=0)
