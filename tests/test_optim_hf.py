"""Our optimizers as a library (cramming.optim.library): a tiny transformers BERT fine-tuned by
`transformers.Trainer` with them, its checkpointed optimizer state restored on resume, and a plain loop."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from cramming.errors import ConfigError
from cramming.optim import AdamW, TrainerOptimizer, create_optimizer, optimizer_state_report

transformers = pytest.importorskip("transformers")

SEQ = 12
VOCAB = 100
# small enough for a few-second Trainer run; min_8bit_size low enough that the low-bit formats are used
SETTINGS = {"lr": 1e-2, "rank": 4, "scale": 1.0, "weight_decay": 0.0, "min_8bit_size": 64}


def tiny_bert(seed: int = 0) -> nn.Module:
    """A 2-layer, hidden-32 BertForSequenceClassification, built locally; no dropout, so losses repeat."""
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=2,
    )
    return transformers.BertForSequenceClassification(config)


class TinyTask(torch.utils.data.Dataset):
    """32 sequences labelled by whether their first token (the one BERT pools) is in the lower half of the
    vocabulary: learnt in a dozen steps."""

    def __init__(self, size: int = 32) -> None:
        g = torch.Generator().manual_seed(7)
        self.input_ids = torch.randint(1, VOCAB, (size, SEQ), generator=g)
        self.labels = (self.input_ids[:, 0] < VOCAB // 2).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


@torch.no_grad()
def task_loss(model: nn.Module, data: TinyTask) -> float:
    model.eval()
    loss = model(input_ids=data.input_ids, labels=data.labels).loss.item()
    model.train()
    return loss


def training_args(out, **kw) -> transformers.TrainingArguments:
    settings = {
        "output_dir": str(out),
        "use_cpu": True,
        "report_to": [],
        "per_device_train_batch_size": 8,
        "lr_scheduler_type": "constant",
        "logging_strategy": "no",
        "save_strategy": "steps",
        "save_steps": 6,
        "max_steps": 12,
        "seed": 0,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }
    return transformers.TrainingArguments(**{**settings, **kw})


def unwrap(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Trainer holds accelerate's wrapper; ours is inside."""
    return getattr(optimizer, "optimizer", optimizer)


class StateAtFirstStep(transformers.TrainerCallback):
    """The optimizer's state dict as the first step (of a run or a resumed run) begins."""

    def __init__(self) -> None:
        self.state_dict = None

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if self.state_dict is None:
            self.state_dict = copy.deepcopy(unwrap(optimizer).state_dict())


def assert_same_state(got: dict, want: dict) -> None:
    """Equal optimizer states: the same entries, every tensor equal in dtype and value (codes included)."""
    assert got["state"].keys() == want["state"].keys()
    for index, entries in want["state"].items():
        assert got["state"][index].keys() == entries.keys(), index
        for key, value in entries.items():
            mine = got["state"][index][key]
            if torch.is_tensor(value):
                assert mine.dtype == value.dtype and torch.equal(mine, value), f"param {index}, {key}"
            else:
                assert mine == value, f"param {index}, {key}"
    for mine, theirs in zip(got["param_groups"], want["param_groups"], strict=True):
        assert mine == theirs


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return optimizer_state_report(unwrap(optimizer))["state_bytes"]


def adamw_state_bytes() -> int:
    """What fp32 torch AdamW holds for the same model after a step."""
    model, data = tiny_bert(), TinyTask()
    opt = torch.optim.AdamW(model.parameters())
    model(input_ids=data.input_ids[:8], labels=data.labels[:8]).loss.backward()
    opt.step()
    return state_bytes(opt)


# --- Trainer ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "low_bit_format"), [("galore_adamw_8bit", "sqrt"), ("adamw_4bit", "rank1_dynamic4")]
)
def test_trainer_fine_tunes_and_resumes_optimizer_state(tmp_path, name, low_bit_format):
    pytest.importorskip("accelerate")
    data = TinyTask()
    kwargs = {"name": name, **SETTINGS}
    model = tiny_bert()
    before = task_loss(model, data)
    trainer = transformers.Trainer(
        model=model,
        args=training_args(tmp_path),
        train_dataset=data,
        optimizer_cls_and_kwargs=(TrainerOptimizer, kwargs),
    )
    trainer.train()
    assert task_loss(model, data) < 0.5 * before

    opt = unwrap(trainer.optimizer)
    assert isinstance(opt, AdamW)
    formats = {s.get("v_map") for s in opt.state.values()}
    assert low_bit_format in formats, formats  # the low-bit state is really in use
    projected = [g for g in opt.param_groups if g["rank"] > 0]
    assert bool(projected) == name.startswith("galore_")
    assert state_bytes(trainer.optimizer) < 0.5 * adamw_state_bytes()

    # resume at step 6 in a new Trainer: the state restored is the one saved, and 6 more steps from it end
    # where the uninterrupted run ended
    saved = torch.load(tmp_path / "checkpoint-6" / "optimizer.pt", weights_only=True)
    final = torch.load(tmp_path / "checkpoint-12" / "optimizer.pt", weights_only=True)
    assert saved["state"] and saved["state"].keys() == final["state"].keys()
    first_step = StateAtFirstStep()
    resumed = transformers.Trainer(
        model=tiny_bert(seed=1),
        args=training_args(tmp_path / "resumed"),
        train_dataset=data,
        optimizer_cls_and_kwargs=(TrainerOptimizer, kwargs),
        callbacks=[first_step],
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-6"))
    assert_same_state(first_step.state_dict, saved)
    assert_same_state(unwrap(resumed.optimizer).state_dict(), final)


def test_trainer_takes_a_built_optimizer(tmp_path):
    """The `optimizers=(optimizer, None)` route: Trainer steps ours and adds its own scheduler."""
    pytest.importorskip("accelerate")
    data = TinyTask()
    model = tiny_bert()
    before = task_loss(model, data)
    optimizer = create_optimizer(model, "galore_adamw_8bit", target_modules=["attention"], **SETTINGS)
    trainer = transformers.Trainer(
        model=model,
        args=training_args(tmp_path, save_strategy="no"),
        train_dataset=data,
        optimizers=(optimizer, None),
    )
    trainer.train()
    assert unwrap(trainer.optimizer) is optimizer
    assert optimizer.state and task_loss(model, data) < 0.5 * before


def test_trainer_refuses_layerwise_with_the_fix(tmp_path):
    pytest.importorskip("accelerate")
    trainer = transformers.Trainer(
        model=tiny_bert(),
        args=training_args(tmp_path, save_strategy="no"),
        train_dataset=TinyTask(),
        optimizer_cls_and_kwargs=(TrainerOptimizer, {"name": "galore_adamw_8bit_layerwise", **SETTINGS}),
    )
    with pytest.raises(ConfigError, match=r"gradient hook.*use `galore_adamw_8bit` with Trainer"):
        trainer.train()


def test_trainer_optimizer_refuses_fsdp_with_the_supported_routes(monkeypatch):
    """Trainer makes its accelerator (with the FSDP plugin) before it calls TrainerOptimizer, and FSDP2
    shards the model only after: accelerate's state is what the factory sees. FSDP needs several processes
    (and accelerate a GPU for its plugin), so this stands in for the state a GPU launch would have."""
    accelerate_state = pytest.importorskip("accelerate.state")

    class FSDPState:  # AcceleratorState's Borg instance, as `accelerate launch` with an FSDP2 config sets it
        fsdp_plugin = object()

    model = tiny_bert()
    assert TrainerOptimizer()(model, "adamw_8bit", lr=1e-3)  # no FSDP: built
    monkeypatch.setattr(accelerate_state, "is_initialized", lambda: True)
    monkeypatch.setattr(accelerate_state, "AcceleratorState", FSDPState)
    for name in ("adamw_8bit", "galore_adamw"):
        with pytest.raises(ConfigError, match="FSDP") as err:
            TrainerOptimizer()(model, name, lr=1e-3)
        assert "Trainer with DDP" in str(err.value) and "impl.distributed=fsdp2" in str(err.value)


def test_trainer_optimizer_refuses_parameter_groups():
    """An older transformers calls the class with its groups: a named error, not a wrong optimizer."""
    model = tiny_bert()
    with pytest.raises(TypeError, match="optimizers=\\(create_optimizer"):
        TrainerOptimizer([{"params": list(model.parameters())}], lr=1e-3)


# --- plain PyTorch ------------------------------------------------------------------------------------


def test_plain_loop_projects_the_targeted_weights_and_learns():
    data = TinyTask()
    model = tiny_bert()
    opt = create_optimizer(model, "galore_adamw_8bit", target_modules="attention.self", **SETTINGS)
    names = {id(p): n for n, p in model.named_parameters()}
    projected = {names[id(p)] for g in opt.param_groups if g["rank"] > 0 for p in g["params"]}
    assert projected == {
        f"bert.encoder.layer.{i}.attention.self.{w}.weight"
        for i in range(2)
        for w in ("query", "key", "value")
    }
    before = task_loss(model, data)
    for step in range(12):
        batch = slice(8 * (step % 4), 8 * (step % 4) + 8)
        loss = model(input_ids=data.input_ids[batch], labels=data.labels[batch]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert task_loss(model, data) < 0.5 * before
    assert state_bytes(opt) < 0.5 * adamw_state_bytes()


def test_create_optimizer_names_a_bad_setting():
    model = tiny_bert()
    with pytest.raises(TypeError, match=r"\['learning_rate'\].*lr"):
        create_optimizer(model, "adamw_8bit", learning_rate=1e-3)
    with pytest.raises(ConfigError, match="create_optimizer.rank"):
        create_optimizer(model, "galore_adamw", rank=0)
