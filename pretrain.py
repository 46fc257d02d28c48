"""Pretrain a BERT-style model within a wall-clock budget: `python pretrain.py budget=24`.

Reads like the recipe: compose the config, prepare (or find) the data, train until the budget is spent.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from cramming.config import register_configs, validate
from cramming.data import prepare_pretraining_data
from cramming.errors import ConfigError, DataSourceError
from cramming.model import KernelUnavailableError
from cramming.train.loop import TrainingDiverged, train

log = logging.getLogger("cramming")
register_configs()


@hydra.main(config_path="conf", config_name="pretrain", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        config = validate(cfg)
        data = prepare_pretraining_data(
            config.data, config.data_cache_root, num_proc=config.impl.preprocessing_procs
        )
    except (ConfigError, DataSourceError) as err:
        log.error("%s", err)
        sys.exit(2)
    if config.dryrun:
        log.info("dryrun: data ready at %s; exiting before training", data.path)
        return
    # the budget clock starts inside train(): preprocessing above does not count against it
    try:
        result = train(config, data, Path(HydraConfig.get().runtime.output_dir))
    except (ConfigError, KernelUnavailableError) as err:
        log.error("%s", err)
        sys.exit(2)
    except TrainingDiverged as err:
        log.error("%s", err)
        sys.exit(3)
    if result.checkpoint is None:  # stopped by a signal, after saving a resumable state
        log.info("interrupted; continue with: python pretrain.py name=%s resume=true ...", config.name)
        sys.exit(128 + signal.Signals[result.stop_reason])


if __name__ == "__main__":
    main()
