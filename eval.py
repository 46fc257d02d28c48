"""Fine-tune and evaluate a pretrained checkpoint on GLUE: `python eval.py checkpoint=<run name or folder>`,
or any local `transformers` model folder: `python eval.py checkpoint=hf:<folder>`.

Reads like the recipe: compose the config, find the checkpoint, fine-tune a fresh copy per task and seed,
write the scores (JSON and a markdown table) into the run folder.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from cramming.config import register_configs, validate
from cramming.eval.backbone import Backbone
from cramming.eval.config import EvalRunConfig
from cramming.eval.run import checkpoint_backbone, earlier_evaluation, glue_record, run_glue
from cramming.job.runcard import RunCard, run_entry_point, run_job
from cramming.job.trackers import start_trackers
from cramming.model.checkpoint import resolve_checkpoint

log = logging.getLogger("cramming")
register_configs()


@hydra.main(config_path="conf", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    # the run card is written however the job ends, and cramming.job.exits says how it ends (exit codes, signals);
    # the GLUE average is what an Optuna search maximizes
    return run_job(evaluate, cfg, kind="eval")


HF_PREFIX = "hf:"


def load_backbone(config: EvalRunConfig) -> tuple[Path, Backbone]:
    """(the folder evaluated, its Backbone): a cramming checkpoint by path or run name, or hf:<folder>."""
    if config.checkpoint.startswith(HF_PREFIX):
        from cramming.hf.load import load_hf_backbone  # transformers: only for hf: folders

        folder = Path(config.checkpoint.removeprefix(HF_PREFIX))
        return folder, load_hf_backbone(folder, config.impl.torch_device())
    checkpoint = resolve_checkpoint(config.checkpoint, config.base_dir)
    return checkpoint, checkpoint_backbone(checkpoint, config.impl)


def evaluate(cfg: DictConfig, card: RunCard) -> float | None:
    config = validate(cfg, EvalRunConfig)
    config.impl.apply_threads()
    checkpoint, backbone = load_backbone(config)
    log.info("evaluating %s on %s with %s", checkpoint, ", ".join(config.eval.tasks), config.eval.optim.name)
    hydra = HydraConfig.get()
    sweep_job = hydra.job.num if hydra.mode == RunMode.MULTIRUN else None  # resume=true: its own number
    run_dir = Path(hydra.runtime.output_dir)
    # W&B, MLflow, TensorBoard (trackers=[...]); resume=true or a requeued job continues the evaluation's runs
    continues = earlier_evaluation(config, run_dir, sweep_job)
    trackers = start_trackers(config.trackers, config.tracking, card, continues)
    # a stop signal ends it with EvaluationStopped, the finished runs kept in the run folder (cramming.job.exits)
    report = run_glue(config, backbone, run_dir, sweep_job=sweep_job)
    card.record_glue(checkpoint, report)
    trackers.log(glue_record(report))
    return report["glue_average"]


if __name__ == "__main__":
    run_entry_point(main)  # configuration errors met by Hydra exit 2, like those the job finds
