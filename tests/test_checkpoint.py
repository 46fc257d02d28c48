"""Final checkpoints (round trip, lookup by path or run name) and resumable states (resume continues steps,
data position and the budget's elapsed time, and ends where an uninterrupted run ends)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
from pathlib import Path

import pytest
import torch
from test_train import (
    FakeClock,
    make_config,
    read_metrics,
    run_dir,
    send_signal_after,
    synthetic_data,
)
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from cramming import utils
from cramming.errors import ConfigError, WriteFailed
from cramming.model import BertForMLM, build_model
from cramming.model import checkpoint as model_checkpoint
from cramming.train import loop
from cramming.train import state as train_state
from cramming.train.mlm import MLMObjective


def save_tiny(tmp_path, model=None, stamp="2026-01-01_00-00-00"):
    cfg = make_config(tmp_path)
    data = synthetic_data(tmp_path)
    model = model or build_model(cfg.arch, data.vocab_size)
    directory = run_dir(cfg, stamp) / model_checkpoint.CHECKPOINT_DIR
    model_checkpoint.save_pretrained(
        torch.compile(model),
        directory,
        data.tokenizer,
        seq_length=32,
        special=data.special,
        info={"updates": 3},
    )
    return cfg, model, directory


def test_round_trip_gives_identical_logits(tmp_path):
    cfg, model, directory = save_tiny(tmp_path)
    input_ids = torch.randint(5, 200, (2, 32))
    labels = torch.where(torch.rand(2, 32) < 0.3, input_ids, -100)
    loaded = model_checkpoint.load_pretrained(directory)
    assert isinstance(loaded.model, BertForMLM)
    model.eval()
    loaded.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.model(input_ids, labels).logits, model(input_ids, labels).logits, rtol=0, atol=0
        )
    assert loaded.model.head.decoder.weight is loaded.model.encoder.embeddings.word.weight
    assert loaded.tokenizer.get_vocab_size() == 200
    assert loaded.config["training"] == {"updates": 3} and loaded.config["seq_length"] == 32


def test_weights_carry_no_compile_prefix(tmp_path):
    from safetensors import safe_open

    _, _, directory = save_tiny(tmp_path)
    with safe_open(str(directory / model_checkpoint.WEIGHTS), "pt") as f:
        keys = list(f.keys())
    assert keys and not any("_orig_mod" in k for k in keys)
    config = json.loads((directory / model_checkpoint.MODEL_CONFIG).read_text())
    assert config["arch"]["name"] == "tiny" and config["vocab_size"] == 200
    assert (directory / model_checkpoint.TOKENIZER).is_file()


def test_checkpoint_found_by_run_folder_and_by_name(tmp_path):
    cfg, _, older = save_tiny(tmp_path, stamp="2026-01-01_00-00-00")
    _, _, newer = save_tiny(tmp_path, stamp="2026-01-02_00-00-00")
    (run_dir(cfg, "2026-01-03_00-00-00")).mkdir()  # a newer run without a final model
    assert model_checkpoint.resolve_checkpoint(older) == older
    assert model_checkpoint.resolve_checkpoint(older.parent) == older
    assert model_checkpoint.resolve_checkpoint("test", base_dir=tmp_path) == newer
    assert model_checkpoint.resolve_checkpoint("test", base_dir=tmp_path, run="2026-01-01_00-00-00") == older
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        model_checkpoint.resolve_checkpoint("other", base_dir=tmp_path)


@pytest.fixture
def ticking(monkeypatch):
    """A fake clock moved 60 s by every micro-batch (wrapping whatever the MLM objective is then)."""
    clock = FakeClock(tick=60.0)

    def install():
        inner = MLMObjective.__call__

        def timed(self, model, batch):
            clock.now += clock.tick
            return inner(self, model, batch)

        monkeypatch.setattr(MLMObjective, "__call__", timed)

    return clock, install


def test_resume_continues_steps_data_and_elapsed_budget(tmp_path, monkeypatch, ticking):
    clock, install_clock = ticking
    data = synthetic_data(tmp_path)

    # reference: uninterrupted, 0.1 h = 360 s at 60 s a micro-batch -> 7 updates, 420 s
    reference_cfg = make_config(tmp_path, "budget=0.1", "name=reference")
    install_clock()
    reference = loop.train(reference_cfg, data, run_dir(reference_cfg), clock=clock)
    assert reference.updates == 7
    monkeypatch.undo()

    # the same run, interrupted by SIGINT during its 4th micro-batch ...
    cfg = make_config(tmp_path, "budget=0.1")
    send_signal_after(monkeypatch, 4, signal.SIGINT)
    install_clock()
    first = loop.train(cfg, data, run_dir(cfg, "2026-01-01_00-00-00"), clock=clock)
    assert first.stop_reason == "SIGINT" and first.updates == 4 and first.elapsed == pytest.approx(240.0)
    monkeypatch.undo()

    # ... then resumed in a new run folder: the budget counts on from 240 s, so 3 more micro-batches
    clock.now += 10_000.0  # downtime between the two parts is not charged
    install_clock()
    resumed_cfg = make_config(tmp_path, "budget=0.1", "resume=true")
    second = loop.train(resumed_cfg, data, run_dir(cfg, "2026-01-01_01-00-00"), clock=clock)
    assert second.stop_reason == "budget"
    assert (second.updates, second.progress.microbatches, second.progress.rows) == (7, 7, 56)
    assert second.elapsed == pytest.approx(420.0)
    assert read_metrics(second.run_dir)[0]["update"] == 5

    # and ends exactly where the uninterrupted run ended: same data, masks, optimizer state
    ours = model_checkpoint.load_pretrained(second.checkpoint).model.state_dict()
    theirs = model_checkpoint.load_pretrained(reference.checkpoint).model.state_dict()
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=0, msg=key)


def test_resume_without_a_state_fails_clearly(tmp_path):
    cfg = make_config(tmp_path, "budget=0.1", "resume=true")
    with pytest.raises(ConfigError, match="no earlier run named 'test'"):
        loop.train(cfg, synthetic_data(tmp_path), run_dir(cfg))


def test_resume_with_another_arch_fails_clearly(tmp_path, monkeypatch):
    send_signal_after(monkeypatch, 2, signal.SIGTERM)
    cfg = make_config(tmp_path, "budget=0.1")
    loop.train(cfg, synthetic_data(tmp_path), run_dir(cfg))
    monkeypatch.undo()
    other = make_config(tmp_path, "budget=0.1", "resume=true", "arch.num_layers=3")
    with pytest.raises(ConfigError, match="arch.num_layers: 2 there, 3 here"):
        loop.train(other, synthetic_data(tmp_path), run_dir(other, "2026-01-01_00-00-01"))


def _stopped_after_two_updates(tmp_path, monkeypatch):
    send_signal_after(monkeypatch, 2, signal.SIGTERM)
    cfg = make_config(tmp_path, "budget=0.1")
    loop.train(cfg, synthetic_data(tmp_path), run_dir(cfg))
    monkeypatch.undo()
    return make_config(tmp_path, "budget=0.1", "resume=true", "train.steps=3")


def _with_vocabulary(data, size: int):
    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])}
    vocab.update({f"w{i}": i for i in range(5, size)})
    return dataclasses.replace(data, tokenizer=Tokenizer(WordLevel(vocab, unk_token="[UNK]")))


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda data: _with_vocabulary(data, 300), "tokenizer_sha256"),  # was a size-mismatch traceback
        (lambda data: dataclasses.replace(data, train=data.train.select(range(1, 256))), "train_rows"),
        (lambda data: dataclasses.replace(data, train=data.train.shuffle(seed=1)), "rows_sha256"),
    ],
    ids=["other-tokenizer", "fewer-rows", "other-order"],
)
def test_resume_on_other_data_is_refused_by_name(tmp_path, monkeypatch, change, named):
    resumed = _stopped_after_two_updates(tmp_path, monkeypatch)
    other = change(synthetic_data(tmp_path / "elsewhere"))
    with pytest.raises(ConfigError, match="other data") as caught:
        loop.train(resumed, other, run_dir(resumed, "2026-01-01_00-00-01"))
    message = str(caught.value)
    assert named in message and "there" in message and "here" in message and "resume=false" in message


def test_resume_on_the_same_data_is_silent_even_from_another_folder(tmp_path, monkeypatch, caplog):
    """Identity is by content: the same rows and tokenizer loaded from another path (a moved cache) resume."""
    resumed = _stopped_after_two_updates(tmp_path, monkeypatch)
    same = synthetic_data(tmp_path / "moved")
    caplog.clear()  # the first run's own SIGTERM warning
    with caplog.at_level(logging.WARNING, logger="cramming"):
        result = loop.train(resumed, same, run_dir(resumed, "2026-01-01_00-00-01"))
    assert result.updates == 3
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_state_is_written_atomically_and_loads_weights_only(tmp_path, monkeypatch):
    send_signal_after(monkeypatch, 2, signal.SIGTERM)
    cfg = make_config(tmp_path, "budget=0.1")
    loop.train(cfg, synthetic_data(tmp_path), run_dir(cfg))
    files = sorted(p.name for p in run_dir(cfg).iterdir())
    assert "state.pt" in files and not any(name.endswith(".tmp") for name in files)
    state = train_state.load_state(run_dir(cfg) / train_state.STATE)
    assert state["step"]["stats"]["updates"] == 2 and not any("_orig_mod" in k for k in state["model"])


def _final_weights(result) -> dict[str, torch.Tensor]:
    return model_checkpoint.load_pretrained(result.checkpoint).model.state_dict()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_resume_after_a_signal_mid_update_is_bit_identical(tmp_path, monkeypatch, signum):
    """Stopped after 3 of the 4 micro-batches of update 3, then resumed: the state is that of the last
    completed update (weights, data position, RNG), so the run ends with the same bits as an uninterrupted
    one. Same code path, same inputs, same process, single-threaded CPU: exact equality is guaranteed.
    Dropout is on, so the torch RNG stream is part of what must match."""
    settings = (
        "budget=1", "train.batch_size=32", "train.batch_size_ramp=0", "train.steps=5",
        "train.lr_schedule=steps-linear", "train.dropout=0.1",
    )  # fmt: skip
    data = synthetic_data(tmp_path)
    reference_cfg = make_config(tmp_path, *settings, "name=reference")
    reference = loop.train(reference_cfg, data, run_dir(reference_cfg))

    cfg = make_config(tmp_path, *settings)
    send_signal_after(monkeypatch, 11, signum)  # update 3 = micro-batches 9-12: stops after the 11th
    first = loop.train(cfg, data, run_dir(cfg, "2026-01-01_00-00-00"))
    assert first.stop_reason == signal.Signals(signum).name and first.updates == 2
    saved = train_state.load_state(run_dir(cfg, "2026-01-01_00-00-00") / train_state.STATE)
    # the last whole update (`microbatches` counts every micro-batch run, the dropped ones too)
    assert (saved["step"]["stats"]["updates"], saved["progress"]["rows"]) == (2, 64)
    monkeypatch.undo()

    resumed_cfg = make_config(tmp_path, *settings, "resume=true")
    second = loop.train(resumed_cfg, data, run_dir(cfg, "2026-01-01_01-00-00"))
    assert second.stop_reason == "steps" and second.updates == 5
    ours, theirs = _final_weights(second), _final_weights(reference)
    worst = max((ours[k] - v).abs().max().item() for k, v in theirs.items())
    assert worst == 0.0, f"max |dw| = {worst:.3e}"


def _interrupted_twice(tmp_path, monkeypatch, ticking):
    """A run that saved a state after every update (a fake minute each) and was stopped by SIGTERM during
    update 4: state.pt is update 4's state, state.prev.pt update 3's."""
    clock, install_clock = ticking
    data = synthetic_data(tmp_path)
    cfg = make_config(tmp_path, "budget=1", "train.checkpoint_every_min=1")
    send_signal_after(monkeypatch, 4, signal.SIGTERM)
    install_clock()
    loop.train(cfg, data, run_dir(cfg), clock=clock)
    monkeypatch.undo()
    folder = run_dir(cfg)
    state = train_state.load_state(folder / train_state.STATE)
    previous = train_state.load_state(folder / train_state.PREVIOUS)
    assert (state["step"]["stats"]["updates"], previous["step"]["stats"]["updates"]) == (4, 3)
    return data, folder


def test_a_truncated_state_falls_back_to_the_previous_one(tmp_path, monkeypatch, ticking, caplog):
    data, folder = _interrupted_twice(tmp_path, monkeypatch, ticking)
    newest = folder / train_state.STATE
    newest.write_bytes(newest.read_bytes()[:1000])  # a truncated write (a disk that filled up)
    resumed = make_config(tmp_path, "budget=1", "resume=true", "train.steps=5")
    caplog.set_level(logging.INFO, logger="cramming")
    result = loop.train(resumed, data, run_dir(resumed, "2026-01-01_01-00-00"))
    assert result.updates == 5
    assert str(newest) in caplog.text and str(folder / train_state.PREVIOUS) in caplog.text
    assert f"resuming from {folder / train_state.PREVIOUS}: update 3" in caplog.text


@pytest.mark.parametrize("damage", ["truncated", "pickle"])
def test_no_loadable_state_fails_naming_the_file(tmp_path, monkeypatch, ticking, damage):
    data, folder = _interrupted_twice(tmp_path, monkeypatch, ticking)
    for name in (train_state.STATE, train_state.PREVIOUS):
        path = folder / name
        if damage == "truncated":
            path.write_bytes(path.read_bytes()[:1000])
        else:  # an object weights_only refuses to unpickle: loading it could run code
            torch.save({"version": 2, "payload": _NotATensor()}, path)
    resumed = make_config(tmp_path, "budget=1", "resume=true")
    with pytest.raises(ConfigError, match="resume=false") as caught:
        loop.train(resumed, data, run_dir(resumed, "2026-01-01_01-00-00"))
    assert str(folder / train_state.STATE) in str(caught.value)
    assert str(folder / train_state.PREVIOUS) in str(caught.value)


class _NotATensor:
    pass


def test_saving_a_state_keeps_the_previous_one_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / train_state.STATE
    for version in (1, 2, 3):
        train_state.save_state(path, {"version": version})
    assert train_state.load_state(path)["version"] == 3
    assert train_state.load_state(tmp_path / train_state.PREVIOUS)["version"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [train_state.PREVIOUS, train_state.STATE]


def _disk_full_midway(obj, f, *args, **kwargs):
    f.write(b"PK\x03\x04 the first bytes of a state")  # part of the file reaches the disk, then:
    raise RuntimeError("[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing file")


def test_a_state_save_that_fails_midway_keeps_the_last_good_state(tmp_path, monkeypatch):
    path = tmp_path / train_state.STATE
    for version in (1, 2):
        train_state.save_state(path, {"version": version, "weights": torch.ones(4)})
    monkeypatch.setattr(train_state.torch, "save", _disk_full_midway)
    with pytest.raises(WriteFailed, match=r"could not write the resumable state .* is kept"):
        train_state.save_state(path, {"version": 3, "weights": torch.zeros(4)})
    assert train_state.load_state(path)["version"] == 2
    assert train_state.load_state(tmp_path / train_state.PREVIOUS)["version"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [train_state.PREVIOUS, train_state.STATE]


def test_a_save_without_the_space_for_it_writes_nothing_and_names_the_space(tmp_path, monkeypatch):
    path = tmp_path / train_state.STATE
    train_state.save_state(path, {"version": 1, "weights": torch.ones(4)})
    free = utils.SPACE_MARGIN_BYTES + 1000  # less than the margin and a 64 MiB state
    monkeypatch.setattr(utils.shutil, "disk_usage", lambda folder: shutil_usage(free))
    with pytest.raises(WriteFailed, match=r"needs about 80 MiB .* 16 MiB free.* base_dir"):
        train_state.save_state(path, {"version": 2, "weights": torch.zeros(16 << 20)})
    assert train_state.load_state(path)["version"] == 1


def shutil_usage(free: int):
    import shutil

    return shutil._ntuple_diskusage(total=10 * free, used=9 * free, free=free)


def test_a_checkpoint_save_that_fails_midway_keeps_the_checkpoint_before(tmp_path, monkeypatch):
    cfg, model, directory = save_tiny(tmp_path)
    before = {name: file.read_bytes() for name, file in _files(directory).items()}

    def fails(model, filename, *args, **kwargs):
        Path(filename).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model_checkpoint, "save_model", fails)
    with pytest.raises(WriteFailed, match="checkpoint already in .* is kept"):
        save_tiny(tmp_path, model)
    assert {name: file.read_bytes() for name, file in _files(directory).items()} == before
    assert [p.name for p in directory.parent.iterdir() if p.name.endswith(".partial")] == []


def _files(directory: Path) -> dict[str, Path]:
    return {p.name: p for p in directory.iterdir()}


@pytest.mark.parametrize("damaged", [model_checkpoint.WEIGHTS, model_checkpoint.MODEL_CONFIG])
def test_a_damaged_checkpoint_names_the_file(tmp_path, damaged):
    _, _, directory = save_tiny(tmp_path)
    path = directory / damaged
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(model_checkpoint.CheckpointUnreadable, match="damaged") as caught:
        model_checkpoint.load_pretrained(directory)
    assert str(path) in str(caught.value) and isinstance(caught.value, ConfigError)  # eval.py: exit 2


def test_two_saves_into_one_place_never_share_a_temporary_folder(tmp_path, monkeypatch):
    """A second save starting while the first is writing (another process, simulated by nesting): each
    writes into a temporary folder of its own, both complete, and none is left behind."""
    data = synthetic_data(tmp_path)
    model = build_model(make_config(tmp_path).arch, data.vocab_size)
    directory = tmp_path / "run" / model_checkpoint.CHECKPOINT_DIR
    write = model_checkpoint._write_checkpoint
    nested = []

    def write_and_let_another_save_run(model, partial, tokenizer, **kwargs):
        if not nested:
            nested.append(partial)
            save(info={"by": "second"})
        write(model, partial, tokenizer, **kwargs)

    def save(info):
        model_checkpoint.save_pretrained(
            model, directory, data.tokenizer, seq_length=32, special=data.special, info=info
        )

    monkeypatch.setattr(model_checkpoint, "_write_checkpoint", write_and_let_another_save_run)
    save(info={"by": "first"})
    assert model_checkpoint.load_pretrained(directory).config["training"] == {"by": "first"}  # the last one
    assert sorted(p.name for p in directory.parent.iterdir()) == [model_checkpoint.CHECKPOINT_DIR]


def test_resuming_removes_the_temporaries_of_a_save_killed_mid_write(tmp_path):
    """A SIGKILL during torch.save leaves the staged state's temporary file; the next resume of that run
    folder deletes it (its process is gone), and keeps those of a live process."""
    run = tmp_path / "run"
    train_state.save_state(run / train_state.STATE, {"version": 2, "x": torch.zeros(2)})
    dead = 2**22 + 12345  # above the largest pid Linux allows (pid_max <= 2**22): no such process
    stale = [
        run / f"..state.pt.{dead}.next.k3y.tmp",
        run / f".state.pt.{dead}.next",
        run / f".state.prev.pt.{dead}.tmp",
    ]
    live = run / f"..state.pt.{os.getpid()}.next.abc.tmp"
    for path in [*stale, live]:
        path.write_bytes(b"half a state")
    found, state = train_state.load_newest_state(run / train_state.STATE)
    assert found == run / train_state.STATE and torch.equal(state["x"], torch.zeros(2))
    assert not any(path.exists() for path in stale) and live.exists()


def test_a_version_3_state_resumes_with_the_one_counter(tmp_path, monkeypatch):
    """Version 3 counted applied updates in `progress` and skipped ones in the step, and kept torch's RNG
    apart: it reads as version 4 with updates = applied + skipped and the RNG in the step's state."""
    send_signal_after(monkeypatch, 3, signal.SIGTERM)
    cfg = make_config(tmp_path, "budget=1", "train.steps=5")
    data = synthetic_data(tmp_path)
    loop.train(cfg, data, run_dir(cfg))
    monkeypatch.undo()
    path = run_dir(cfg) / train_state.STATE
    state = train_state.load_state(path)
    step = dict(state["step"])
    rng = step.pop("rng")
    stats = step["stats"]
    v3 = {
        **state,
        "version": 3,
        "progress": {**state["progress"], "updates": stats["updates"] - 1},  # as if one had been skipped
        "step": {**step, "stats": {"applied": stats["updates"] - 1, "skipped": 1, "skipped_in_a_row": 0}},
        "rng": {"torch": rng["torch"], "cuda": rng["cuda"]},
    }
    upgraded = train_state.TrainingState.from_dict(v3, path)
    assert upgraded.updates == 3 and upgraded.step["stats"]["skipped"] == 1
    assert "updates" not in vars(upgraded.progress) and torch.equal(
        upgraded.step["rng"]["torch"], rng["torch"]
    )
    train_state.save_state(path, v3)
    resumed = loop.train(cfg, data, run_dir(cfg))  # its own folder: continues from the version-3 state
    assert resumed.stop_reason == "steps" and resumed.updates == 5 and resumed.skipped == 1
