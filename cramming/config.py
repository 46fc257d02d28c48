"""Top-level typed configuration and its Hydra registration.

Each Hydra group (`arch`, `data`, `train`, `impl`) is backed by a dataclass that lives beside the code it
configures. Composition against these schemas rejects unknown keys and wrongly typed values; `validate`
then builds the dataclasses, whose `__post_init__` checks ranges and choices. Both fail at start-up with a
message that names the key.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from cramming.data.config import DataConfig
from cramming.errors import ConfigError, config_error
from cramming.eval.anytime import AnytimeConfig
from cramming.eval.config import EvalRunConfig
from cramming.impl import ImplConfig
from cramming.job.cluster import job_minutes
from cramming.model.config import ArchConfig
from cramming.runs import claim_run_dir
from cramming.trackers.config import TrackingConfig
from cramming.trackers.registry import check_trackers
from cramming.train.autobatch import check_batch_division
from cramming.train.config import TrainConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


@dataclass
class PretrainConfig:
    """`python pretrain.py`: one pretraining run."""

    arch: ArchConfig = MISSING
    data: DataConfig = MISSING
    train: TrainConfig = MISSING
    impl: ImplConfig = field(default_factory=ImplConfig)
    # wall-clock budget in hours; compile and data loading count against it, preprocessing does not
    budget: float = 24.0
    # run name: outputs go to {base_dir}/{name}/{timestamp}/
    name: str = "default"
    # seeds the model's initialization, the masking and the data order of the run
    seed: int = 0
    # preprocess the data (or find it in the cache) and exit
    dryrun: bool = False
    # root of run folders and of the processed-data cache ({base_dir}/data)
    base_dir: str = "outputs"
    # continue the newest run of this name that left a resumable state; its budget keeps counting
    resume: bool = False
    # GLUE fine-tuning of the current weights at fractions of the budget (cramming/eval/anytime.py); off by default
    anytime: AnytimeConfig = field(default_factory=AnytimeConfig)
    # experiment trackers the run also goes to: tensorboard | wandb | mlflow (docs/tracking.md); empty: none
    trackers: list[str] = field(default_factory=list)
    # where they send it (W&B project and mode, MLflow URI)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        check_trackers(self.trackers)
        if not self.budget > 0:  # also refuses nan; inf is refused by validate with every other number
            raise config_error(
                "budget", self.budget, "give the wall-clock budget in hours, e.g. budget=24 or budget=0.1"
            )
        check_batch_division(self.train.batch_size, self.impl.microbatch_size)
        if self.train.clock == "reference":
            if self.impl.microbatch_size == "auto":
                raise config_error(
                    "impl.microbatch_size", "auto", "on train.clock=reference give a number: auto chooses by"
                    " this machine's speed, and the calibration prices one micro-batch size",
                )  # fmt: skip
            if self.anytime.at and self.anytime.charged:
                raise config_error(
                    "anytime.charged", True, "the reference clock charges calibrated costs only, and"
                    " evaluations are not calibrated: use anytime.charged=false, or train.clock=wall",
                )  # fmt: skip
        if not self.name or "/" in self.name:
            raise config_error("name", self.name, "use a plain folder name without '/'")
        if self.data.seq_length > self.arch.max_seq_length:
            raise config_error(
                "data.seq_length",
                self.data.seq_length,
                f"arch {self.arch.name} covers at most arch.max_seq_length={self.arch.max_seq_length} positions",
            )

    @property
    def tracker_names(self) -> list[str]:
        """`trackers`, and tensorboard for the deprecated train.tensorboard=true."""
        legacy = ["tensorboard"] if self.train.tensorboard and "tensorboard" not in self.trackers else []
        return [*self.trackers, *legacy]

    @property
    def data_cache_root(self) -> Path:
        return Path(self.base_dir) / "data"


def arch_preset(name: str, overrides: list[str] | tuple[str, ...] = ()) -> ArchConfig:
    """conf/arch/<name>.yaml with `key=value` overrides (`num_layers=4`), checked as a run checks its `arch`:
    for the scripts that build a model without Hydra. Raises ConfigError naming an unknown preset, key or value."""
    path = CONF_DIR / "arch" / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        raise config_error("arch", name, f"choose one of conf/arch/: {known}")
    try:
        merged = OmegaConf.merge(
            OmegaConf.structured(ArchConfig), OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides))
        )
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except Exception as err:  # omegaconf's refusals: an unknown key, a value of the wrong type
        raise ConfigError(f"arch {name} with {' '.join(overrides) or 'no overrides'}: {err}") from err


def register_configs() -> None:
    """Make the schemas known to Hydra; the YAML files in conf/ name them first in their defaults."""
    cs = ConfigStore.instance()
    cs.store(name="pretrain_schema", node=PretrainConfig)
    cs.store(name="eval_schema", node=EvalRunConfig)
    # hydra.run.dir / hydra.sweep.dir: ${run_dir:${base_dir},${name},<stamp>} claims a folder of its own. Cached:
    # a launcher that runs each job in a process of its own (submitit) hands the job the sweep config's
    # cache, so the job resolves the sweep folder its launcher claimed instead of claiming another
    OmegaConf.register_new_resolver("run_dir", claim_run_dir, replace=True, use_cache=True)
    # conf/hydra/launcher/*.yaml: a job's time limit from its budget
    OmegaConf.register_new_resolver("job_minutes", job_minutes, replace=True)


def unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Dotted keys of `node` that its schema (the dataclass behind each level) does not have: added with
    Hydra's `+key=value`, which composition lets through."""
    kind = OmegaConf.get_type(node)
    known = {f.name for f in dataclasses.fields(kind)} if dataclasses.is_dataclass(kind) else None
    found = []
    for key in node:
        path = f"{prefix}{key}"
        if known is not None and key not in known:
            found.append(path)
            continue
        child = node._get_node(key)  # the node itself: nothing is resolved
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            found += unknown_keys(child, f"{path}.")
    return found


def non_finite_numbers(value: object, prefix: str = "") -> list[str]:
    """Dotted keys of every float in a config object that is nan or infinite: no setting takes one (a budget
    of nan would train forever at a learning rate of nan)."""
    if dataclasses.is_dataclass(value):
        items = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
    elif isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return [prefix.rstrip(".")] if isinstance(value, float) and not math.isfinite(value) else []
    return [key for name, item in items for key in non_finite_numbers(item, f"{prefix}{name}.")]


def validate(cfg: DictConfig, schema: type = PretrainConfig):
    """Turn the composed config into typed dataclasses, running every field check.

    Raises ConfigError naming the key at fault.
    """
    unknown = unknown_keys(cfg)
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {', '.join(unknown)}: {schema.__name__} has no such key (added with `+`?)."
            " Check the spelling against conf/ (`--cfg job` prints every key) and drop the `+`"
        )
    try:
        plain = OmegaConf.to_container(cfg, resolve=True)
    except Exception as err:  # omegaconf's own errors: missing values, failed interpolations
        raise ConfigError(f"invalid configuration: {err}") from err
    bad = non_finite_numbers(plain)
    if bad:
        values = ", ".join(f"{key}={OmegaConf.select(cfg, key)}" for key in bad)
        raise ConfigError(f"{values}: every number must be finite. Give a finite value (budgets in hours)")
    try:
        obj = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except Exception as err:  # omegaconf's own errors: missing values, failed conversions
        raise ConfigError(f"invalid configuration: {err}") from err
    if not isinstance(obj, schema):
        raise ConfigError(f"expected a {schema.__name__} config, got {type(obj).__name__}")
    return obj
