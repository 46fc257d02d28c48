"""`impl.microbatch_size=auto`: the search logic with fake measurements and a fake clock, the CPU memory cap,
the cache, the config value, and a training run that uses it. No timing is asserted."""

from __future__ import annotations

import json

import pytest
import torch
from test_train import make_config, synthetic_data

from cramming.errors import ConfigError
from cramming.impl import ImplConfig
from cramming.model import ArchConfig, build_model
from cramming.train import autobatch, loop
from cramming.train.autobatch import TooLarge, choose_microbatch, search
from cramming.train.config import MLMConfig
from cramming.train.mlm import MLMMasker, MLMObjective

SIZES = [1, 2, 4, 8, 16, 32, 64]


def fake_measure(rates: dict[int, float], too_large_from: int | None = None, calls: list | None = None):
    def measure(size: int) -> float:
        if calls is not None:
            calls.append(size)
        if too_large_from is not None and size >= too_large_from:
            raise TooLarge("fake out of memory")
        return rates[size]

    return measure


def test_picks_fastest_and_stops_at_the_first_size_that_does_not_fit():
    calls = []
    rates = {1: 10, 2: 19, 4: 35, 8: 60, 16: 90, 32: 120, 64: 150}
    chosen, trials = search(fake_measure(rates, too_large_from=32, calls=calls), SIZES, time_limit=1e9)
    assert chosen == 16
    assert calls == [1, 2, 4, 8, 16, 32]  # 64 is never tried
    assert trials[-1].seq_per_s is None and "too large" in trials[-1].note


def test_prefers_the_smallest_size_within_tolerance_and_stops_after_two_slower_sizes():
    calls = []
    rates = {1: 10, 2: 50, 4: 99, 8: 100, 16: 98, 32: 97, 64: 500}
    chosen, _ = search(fake_measure(rates, calls=calls), SIZES, time_limit=1e9)
    assert calls == [1, 2, 4, 8, 16, 32]  # two sizes slower than 8 in a row: 64 is not tried
    assert chosen == 4  # 99 is within 3% of the best (100)


def test_respects_its_time_bound():
    """Each measurement takes `size` seconds of a fake clock: the search never starts one that would end past
    the limit, and always measures the first size."""
    now = [0.0]

    def measure(size: int) -> float:
        now[0] += size
        return float(size)

    chosen, trials = search(measure, SIZES, time_limit=10.0, clock=lambda: now[0])
    measured = [t.microbatch for t in trials if t.seq_per_s is not None]
    assert measured == [1, 2, 4]  # 1 + 2 + 4 = 7 s; 8 would end at 15 s
    assert now[0] <= 10.0
    assert chosen == 4 and trials[-1].note == "not measured: time limit"

    now[0] = 0.0
    chosen, trials = search(measure, [16, 32], time_limit=1.0, clock=lambda: now[0])
    assert chosen == 16 and len([t for t in trials if t.seq_per_s]) == 1  # the first one always runs


def test_nothing_fits():
    with pytest.raises(TooLarge, match="impl.microbatch_size=auto"):
        search(fake_measure({}, too_large_from=1), SIZES, time_limit=1e9)


def test_cpu_cap_is_a_power_of_two_that_shrinks_with_memory():
    arch = ArchConfig()
    big = autobatch.cpu_max_microbatch(arch, 128, available_bytes=64 * 2**30)
    small = autobatch.cpu_max_microbatch(arch, 128, available_bytes=2 * 2**30)
    assert big & (big - 1) == 0 and small & (small - 1) == 0
    assert 1 <= small < big <= autobatch.CPU_MAX
    assert autobatch.cpu_max_microbatch(arch, 128, available_bytes=0) == 1


def test_choose_measures_once_then_reuses_the_cache(tmp_path, monkeypatch):
    arch = ArchConfig(name="t", num_layers=1, hidden_size=16, num_heads=2, intermediate_size=32)
    model = build_model(arch, 64, dropout=0.0)
    objective = MLMObjective(
        MLMMasker(MLMConfig(), 64, (0, 1, 2, 3, 4), mask_id=4), torch.device("cpu"), None
    )
    cache = tmp_path / "autobatch.json"
    before = [p.detach().clone() for p in model.parameters()]
    rng_before = torch.get_rng_state()
    kwargs = {"cache_path": cache, "most": 8, "time_limit": 60.0}
    chosen = choose_microbatch(model, objective, torch.float32, 16, **kwargs)
    assert chosen in (1, 2, 4, 8)
    assert all(
        torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
    )  # weights untouched
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(
        torch.get_rng_state(), rng_before
    )  # the search leaves the random streams as it found them
    (record,) = json.loads(cache.read_text()).values()
    assert record["microbatch_size"] == chosen and record["trials"]

    def no_search(*args, **kwargs):
        raise AssertionError("searched again despite the cache")

    monkeypatch.setattr(autobatch, "search", no_search)
    assert choose_microbatch(model, objective, torch.float32, 16, **kwargs) == chosen
    other = build_model(
        ArchConfig(name="t", num_layers=2, hidden_size=16, num_heads=2, intermediate_size=32), 64
    )
    with pytest.raises(AssertionError, match="searched again"):  # another shape is another cache entry
        choose_microbatch(other, objective, torch.float32, 16, **kwargs)
    with pytest.raises(ConfigError, match="several processes"):
        choose_microbatch(other, objective, torch.float32, 16, **kwargs, search_allowed=False)


@pytest.mark.parametrize("value, expected", [("auto", "auto"), (64, 64), ("32", 32)])
def test_config_accepts_a_number_or_auto(value, expected):
    assert ImplConfig(microbatch_size=value).microbatch_size == expected


@pytest.mark.parametrize("value", ["fast", 0, -4, 2.5, True])
def test_config_rejects_anything_else_naming_the_key(value):
    with pytest.raises(ConfigError, match="impl.microbatch_size"):
        ImplConfig(microbatch_size=value)


def test_compile_auto_is_on_for_cuda_only():
    impl = ImplConfig()
    assert impl.compile == "auto"
    assert impl.compile_on(torch.device("cuda")) and not impl.compile_on(torch.device("cpu"))
    assert ImplConfig(compile=True).compile_on(torch.device("cpu"))
    with pytest.raises(ConfigError, match="impl.compile"):
        ImplConfig(compile="sometimes")


def test_training_run_with_auto(tmp_path):
    cfg = make_config(tmp_path, "impl.microbatch_size=auto", "train.steps=2", "budget=1")
    result = loop.train(cfg, synthetic_data(tmp_path / "data"), tmp_path / "run")
    assert result.stop_reason == "steps"
    assert cfg.impl.microbatch_size == "auto"  # the choice is passed down, the config is never written
    (record,) = json.loads((tmp_path / autobatch.CACHE_FILE).read_text()).values()
    assert record["microbatch_size"] in autobatch.powers_of_two(cfg.train.batch_size)
    # every update trained on whole micro-batches of the chosen size
    assert result.progress.rows == 2 * cfg.train.batch_size
