"""The command line before Hydra reads it, and Hydra's refusals after: what a user typed, made to work or
explained in one line.

    rewrite_shorthands(argv)   `train.optim=adamw_8bit` (the transformers spelling) -> the group choice
                               `train/optim=adamw_8bit`; `eval.optim=<name>` -> `eval.optim.name=<name>`
    explain(err)               the message of a configuration error, with the closest valid keys for an
                               unknown one (`arch.num_head` -> arch.num_heads)
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import re

from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from cramming.errors import ConfigError
from cramming.optim import OPTIMIZERS

log = logging.getLogger("cramming")

# `[+]train.optim=<names>` / `[+]eval.optim=<names>`, names comma-separated for a multirun; not a dict `{...}`
_OPTIM_SHORTHAND = re.compile(r"^(?P<plus>\+{0,2})(?P<scope>train|eval)\.optim=(?P<names>[A-Za-z0-9_,]+)$")


def rewrite_shorthands(argv: list[str]) -> list[str]:
    """argv with `train.optim=<name>` read as the config group `train/optim=<name>` (its settings file, as
    transformers' `optim=` name means the whole optimizer) and `eval.optim=<name>` as `eval.optim.name=<name>`
    (evaluation sets its optimizer's fields one by one). A name that is no optimizer is refused naming them."""
    out = []
    for arg in argv:
        match = _OPTIM_SHORTHAND.match(arg)
        if match is None:
            out.append(arg)
            continue
        scope, names = match["scope"], match["names"]
        unknown = [name for name in names.split(",") if name not in OPTIMIZERS]
        if unknown:
            raise ConfigError(
                f"`{arg}`: {', '.join(map(repr, unknown))} is no optimizer; choose one of: {', '.join(OPTIMIZERS)}"
                f" (e.g. {scope}{'/' if scope == 'train' else '.'}optim{'' if scope == 'train' else '.name'}"
                f"=adamw_8bit)"
            )
        rewritten = f"{scope}/optim={names}" if scope == "train" else f"{scope}.optim.name={names}"
        log.info("%s is read as %s", arg, rewritten)
        out.append(rewritten)
    return out


def explain(err: BaseException) -> str:
    """The message of the innermost ConfigError behind `err` (ours name the key and the fix); else the chain's
    messages (Hydra's 'Could not override ...', omegaconf's 'full_key: ...'), with the closest valid keys
    when a key is unknown."""
    chain, seen, hint = [], set(), ""
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, ConfigError):
            return str(err)
        if isinstance(err, (ConfigKeyError, ConfigAttributeError)) and not hint:
            hint = _closest_keys_hint(err)
        chain.append(str(err).strip())
        err = err.__cause__
    return "\n".join(dict.fromkeys(m for m in [*chain, hint] if m))


def _closest_keys_hint(err: ConfigKeyError | ConfigAttributeError) -> str:
    """'did you mean: arch.num_heads?' for an unknown key of a typed config group, or ''."""
    owner, key = getattr(err, "object_type", None), getattr(err, "key", None)
    if not (isinstance(key, str) and dataclasses.is_dataclass(owner)):
        return ""
    close = closest(key, [field.name for field in dataclasses.fields(owner)])
    if not close:
        return ""
    full_key = str(getattr(err, "full_key", key) or key)
    prefix = full_key[: -len(key)] if full_key.endswith(key) else ""
    return f"did you mean: {', '.join(prefix + name for name in close)}?"


def closest(key: str, candidates: list[str], n: int = 3) -> list[str]:
    """The candidates nearest to `key`: by spelling, or by sharing a word of it (`num_attention_heads` ->
    `num_heads`), best first."""

    def score(candidate: str) -> float:
        spelling = difflib.SequenceMatcher(None, key, candidate).ratio()
        words, theirs = set(key.split("_")), set(candidate.split("_"))
        shared = len(words & theirs) / len(words | theirs)
        return max(spelling, shared + 0.1 * spelling)

    ranked = sorted(candidates, key=score, reverse=True)
    return [c for c in ranked[:n] if score(c) >= 0.5]
