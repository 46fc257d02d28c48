"""Evaluate a pretrained checkpoint: `python eval.py checkpoint=<run name or folder>` fine-tunes it on GLUE,
`python eval.py checkpoint=<...> eval=blimp` scores BLiMP's minimal pairs zero-shot. Any local `transformers`
model folder works too: `checkpoint=hf:<folder>`.

Reads like the recipe: compose the config, find the checkpoint, fine-tune a fresh copy per task and seed (or
score every paradigm), write the scores into the run folder.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from cramming.config import register_configs, validate
from cramming.eval import blimp
from cramming.eval.backbone import Backbone
from cramming.eval.config import EvalRunConfig
from cramming.eval.run import checkpoint_backbone, earlier_evaluation, glue_record, run_glue
from cramming.job.runcard import RunCard, run_entry_point, run_job
from cramming.job.trackers import start_trackers
from cramming.model.checkpoint import load_pretrained, resolve_checkpoint
from cramming.optim.step import autocast

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


def load_masked_lm(config: EvalRunConfig) -> tuple[Path, blimp.MaskedLM]:
    """(the folder evaluated, its masked LM), for zero-shot scoring: a cramming checkpoint (its encoder and
    decoder, under impl's precision) or hf:<folder>."""
    device = config.impl.torch_device()
    if config.checkpoint.startswith(HF_PREFIX):
        from cramming.hf.load import load_hf_masked_lm  # transformers: only for hf: folders

        folder = Path(config.checkpoint.removeprefix(HF_PREFIX))
        return folder, load_hf_masked_lm(folder, device)
    checkpoint = resolve_checkpoint(config.checkpoint, config.base_dir)
    pretrained = load_pretrained(checkpoint, config.base_dir, device=device, **config.impl.kernel_choices())
    dtype, why = config.impl.precision_choice(device)
    log.info("scoring precision %s (%s)", str(dtype).removeprefix("torch."), why)
    mask_id = pretrained.config["special_tokens"]["mask"]
    forward_in = functools.partial(autocast, device.type, dtype)
    return checkpoint, blimp.CrammedMaskedLM(pretrained.model, pretrained.tokenizer, mask_id, forward_in)


def evaluate_blimp(config: EvalRunConfig, card: RunCard) -> float:
    """BLiMP zero-shot: every paradigm not yet scored, into blimp_scores.jsonl and blimp_results.json."""
    checkpoint, lm = load_masked_lm(config)
    run_dir, sweep_job = job_folder()
    continues = blimp.earlier_evaluation(run_dir, config.resume, config.base_dir, config.name, sweep_job)
    blimp.take_up(continues, run_dir, blimp.recipe_of(config.blimp, str(checkpoint)))
    trackers = start_trackers(config.trackers, config.tracking, card, continues)
    results = blimp.evaluate(lm, config.blimp, run_dir, Path(config.base_dir) / "data" / "hf")
    card.record_blimp(checkpoint, results)
    trackers.log(blimp.tracker_record(results))
    return results["overall"]


def job_folder() -> tuple[Path, int | None]:
    """(this job's run folder, its number in a multirun or None)."""
    hydra = HydraConfig.get()
    return Path(hydra.runtime.output_dir), hydra.job.num if hydra.mode == RunMode.MULTIRUN else None


def evaluate(cfg: DictConfig, card: RunCard) -> float | None:
    config = validate(cfg, EvalRunConfig)
    config.impl.apply_to_process(config.impl.torch_device())
    if config.benchmark == "blimp":
        return evaluate_blimp(config, card)
    checkpoint, backbone = load_backbone(config)
    log.info("evaluating %s on %s with %s", checkpoint, ", ".join(config.eval.tasks), config.eval.optim.name)
    run_dir, sweep_job = job_folder()  # resume=true in a multirun: the same job number of the last one
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
