"""Pretrain a BERT-style model within a wall-clock budget: `python pretrain.py budget=24`.

Reads like the recipe: compose the config, prepare (or find) the data, train until the budget is spent.
"""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from cramming.calibration import run_costs
from cramming.config import PretrainConfig, register_configs, validate
from cramming.data import PretrainingData, prepare_pretraining_data
from cramming.eval.anytime import AnytimeEval
from cramming.job.exits import RunStopped, stop_at_once
from cramming.job.runcard import RunCard, run_entry_point, run_job
from cramming.job.summary import summary
from cramming.job.trackers import start_trackers
from cramming.ranks import init_from_env, local_main_first, rank_zero_value, shutdown
from cramming.train import state as train_state
from cramming.train.loop import TrainResult, train

log = logging.getLogger("cramming")
register_configs()


@hydra.main(config_path="conf", config_name="pretrain", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    # the run card is written however the job ends, and cramming.job.exits says how it ends (exit codes, signals);
    # the validation loss is what an Optuna search minimizes
    return run_job(pretrain, cfg, kind="pretrain")


def pretrain(cfg: DictConfig, card: RunCard) -> float | None:
    config = validate(cfg)
    ranks = init_from_env(config.impl.torch_device(), config.impl.distributed)  # under torchrun: one per GPU
    # one process per machine preprocesses (or finds the cache); the others then load its result. A stop
    # signal here stops at once: the half-built data folder is removed and the card says interrupted
    with card.timed("data"), local_main_first(ranks), stop_at_once("preprocessing"):
        data = prepare_pretraining_data(
            config.data, config.data_cache_root, num_proc=config.impl.preprocessing_procs
        )
    # GLUE fine-tuning during pretraining, handed to the loop as a hook; its tasks are loaded now
    hooks = (
        [AnytimeEval(config.anytime, data, config.impl, config.data_cache_root / "hf")]
        if config.anytime.at
        else []
    )
    card.record_pretraining_data(data.path, data.stats, data.vocab_size)
    if config.dryrun:
        log.info("dryrun: data ready at %s; exiting before training", data.path)
        return None
    # on the reference clock a shape its calibration lacks is refused now, naming the command with these overrides
    overrides = shlex.join(HydraConfig.get().overrides.task)
    run_costs(config, data.vocab_size, data.seq_length, ranks.world_size, overrides)
    # the budget clock starts inside train(): preprocessing above does not count against it
    run_dir = rank_zero_value(ranks, Path(HydraConfig.get().runtime.output_dir))  # one for all
    # W&B, MLflow, TensorBoard (trackers=[...]): before the budget clock starts; a resumed run continues theirs
    continues = train_state.continued_run_dir(run_dir, config.resume, config.base_dir, config.name)
    trackers = start_trackers(config.tracker_names, config.tracking, card, continues, main=ranks.is_main)
    with card.timed("train"):
        result = train(config, data, run_dir, hooks=hooks, on_record=trackers.log)
    shutdown()
    card.record_pretraining(
        stop_reason=result.stop_reason,
        updates=result.updates,
        rows=result.progress.rows,
        elapsed=result.elapsed,
        elapsed_before=result.elapsed_before,
        validation=result.validation,
        finished=result.checkpoint is not None,
        clock=result.clock,
        wall_seconds=result.wall_seconds,
    )
    if result.checkpoint is None:  # stopped by a signal, after saving a resumable state (cramming.job.exits)
        raise RunStopped(result.stop_reason, f"a resumable state is saved in {run_dir}")
    if ranks.is_main:
        log.info("\n%s", summarize(config, result, data))
    return (result.validation or {}).get("loss")


def summarize(config: PretrainConfig, result: TrainResult, data: PretrainingData) -> str:
    """What was learned, where the model is and what to run next: the last lines a newcomer reads."""
    return summary(
        arch=config.arch.name,
        hidden_size=config.arch.hidden_size,
        updates=result.updates,
        tokens=result.progress.rows * data.seq_length,
        minutes=result.elapsed / 60,
        validation=result.validation,
        vocab_size=data.vocab_size,
        checkpoint=result.checkpoint,
        name=config.name,
        base_dir=str(config.base_dir),
    )


if __name__ == "__main__":
    run_entry_point(main)  # configuration errors met by Hydra exit 2, like those the job finds
