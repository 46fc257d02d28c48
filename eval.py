"""Fine-tune and evaluate a pretrained checkpoint on GLUE: `python eval.py checkpoint=<run name or folder>`.

Reads like the recipe: compose the config, find the checkpoint, fine-tune a fresh copy per task and seed,
write the scores (JSON and a markdown table) into the run folder.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from cramming.config import register_configs, validate
from cramming.errors import ConfigError
from cramming.eval.config import EvalRunConfig
from cramming.eval.run import checkpoint_backbone, run_glue
from cramming.model import KernelUnavailableError
from cramming.model.checkpoint import resolve_checkpoint
from cramming.runcard import JobFailed, RunCard, run_job

log = logging.getLogger("cramming")
register_configs()


@hydra.main(config_path="conf", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_job(evaluate, cfg, kind="eval")  # the run card is written however the job ends


def evaluate(cfg: DictConfig, card: RunCard) -> None:
    try:
        config = validate(cfg, EvalRunConfig)
        checkpoint = resolve_checkpoint(config.checkpoint, config.base_dir)
    except (ConfigError, FileNotFoundError) as err:
        raise JobFailed(err, exit_code=2) from err
    log.info("evaluating %s on %s with %s", checkpoint, ", ".join(config.eval.tasks), config.eval.optim.name)
    config.impl.apply_threads()
    try:
        backbone = checkpoint_backbone(checkpoint, config.impl, config.base_dir)
        report = run_glue(config, backbone, Path(HydraConfig.get().runtime.output_dir))
    except (ConfigError, KernelUnavailableError) as err:
        raise JobFailed(err, exit_code=2) from err
    card.record_glue(checkpoint, report)


if __name__ == "__main__":
    main()
