"""Typed configuration of the `tracking` group: where the trackers named in `trackers` send a run."""

from __future__ import annotations

from dataclasses import dataclass

from cramming.errors import check_choice, config_error

WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class TrackingConfig:
    """`tracking`: settings of the trackers (docs/tracking.md). Each tracker also honours its own environment
    variables (WANDB_MODE, WANDB_DIR, WANDB_ENTITY, MLFLOW_TRACKING_URI, ...) where a setting here is null."""

    # the W&B project and the MLflow experiment that runs go to
    project: str = "cramming"
    # W&B entity (user or team); null: WANDB_ENTITY, else the account's default
    entity: str | None = None
    # W&B mode: online | offline (sync later with `wandb sync`) | disabled; null: WANDB_MODE, else online
    wandb_mode: str | None = None
    # MLflow tracking URI: http(s)://host:port or sqlite:///file.db (a folder needs MLFLOW_ALLOW_FILE_STORE=true
    # in MLflow 3); null: MLFLOW_TRACKING_URI, else sqlite:///{base_dir}/mlflow.db
    mlflow_uri: str | None = None
    # seconds a tracker may take to start (and a tracking server to answer) before it is dropped for the run
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.project:
            raise config_error(
                "tracking.project", self.project, "name a project, e.g. tracking.project=cramming"
            )
        if self.wandb_mode is not None:
            check_choice("tracking.wandb_mode", self.wandb_mode, WANDB_MODES)
        if not self.timeout_s > 0:
            raise config_error(
                "tracking.timeout_s", self.timeout_s, "use a positive number of seconds, e.g. 30"
            )
