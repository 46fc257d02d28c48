"""Any local `transformers` encoder folder as a fine-tuning Backbone: `python eval.py checkpoint=hf:<folder>`.

The folder needs the model (config.json + weights) and a fast tokenizer (tokenizer.json) whose post-processor
adds the special tokens itself ([CLS] a [SEP] (b [SEP]) for BERT), since fine-tuning encodes with the
`tokenizers` library and classifies from the first token. Nothing is downloaded: the folder is read as is.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM, PretrainedConfig

import cramming.hf  # noqa: F401  (registers crammed_bert: our own exports need no remote code)
from cramming.errors import ConfigError, check_readable, first_line
from cramming.eval.backbone import Backbone
from cramming.eval.blimp import TransformersMaskedLM
from cramming.model.checkpoint import CheckpointUnreadable


class HFEncoder(nn.Module):
    """A transformers base model behind the Backbone encoder interface: (batch, seq) ids -> (batch, seq, hidden)
    last hidden states. Token types are passed only to models that take them (DistilBERT, e.g., does not)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.takes_token_types = "token_type_ids" in inspect.signature(model.forward).parameters

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kwargs = {"attention_mask": None if attention_mask is None else attention_mask.long()}
        if self.takes_token_types:
            kwargs["token_type_ids"] = token_type_ids
        return self.model(input_ids=input_ids, **kwargs).last_hidden_state  # (batch, seq, hidden)


def _base_model(folder: Path, config: PretrainedConfig, trust_remote_code: bool) -> nn.Module:
    """The encoder without any head. A masked-LM folder is loaded as one (its base model keeps every saved
    encoder weight, and no pooler appears that the folder does not hold); any other folder through AutoModel."""
    kwargs = {"config": config, "trust_remote_code": trust_remote_code}
    if any(name.endswith("ForMaskedLM") for name in config.architectures or ()):
        return AutoModelForMaskedLM.from_pretrained(folder, **kwargs).base_model
    return AutoModel.from_pretrained(folder, **kwargs)


def _special_token(folder: Path, tokenizer: Tokenizer, kind: str, default: str) -> int | None:
    """The id of the `kind` token (pad, cls, ...) named in tokenizer_config.json, else the BERT name."""
    name = default
    path = folder / "tokenizer_config.json"
    if path.is_file():
        value = json.loads(path.read_text()).get(f"{kind}_token")
        name = value.get("content", default) if isinstance(value, dict) else value or default
    return tokenizer.token_to_id(name)


def load_tokenizer(folder: Path) -> Tokenizer:
    """The folder's tokenizer.json, checked to add special tokens around a sentence and a pair itself."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} has no tokenizer.json: fine-tuning needs a fast tokenizer file. Write one with"
            f" transformers.AutoTokenizer.from_pretrained({str(folder)!r}).save_pretrained(<same folder>)"
        )
    tokenizer = Tokenizer.from_file(str(path))
    single = tokenizer.encode("a b")
    pair = tokenizer.encode("a b", "c d")
    for what, encoding in (("a sentence", single), ("a pair", pair)):
        mask = encoding.special_tokens_mask
        if not mask or not (mask[0] and mask[-1]):
            raise ConfigError(
                f"{path}: its post-processor does not put special tokens around {what} ({encoding.tokens}):"
                " fine-tuning classifies from the first token and needs [CLS] a [SEP] (b [SEP])"
            )
    return tokenizer


@contextmanager
def naming(path: Path, what: str = "") -> Iterator[None]:
    """Turn a failure to read `path` (JSON that does not parse, weights that do not load, ...) into a
    CheckpointUnreadable naming the file and the fix; errors that already say so pass through."""
    try:
        yield
    except (ConfigError, FileNotFoundError, ImportError):
        raise
    except Exception as err:
        reason = first_line(err)
        raise CheckpointUnreadable(
            f"{path}{' (' + what + ')' if what else ''} does not load ({type(err).__name__}: {reason}): the"
            " transformers folder is damaged or incomplete. Save or copy it again, or evaluate another model"
        ) from err


def model_folder(folder: str | Path) -> Path:
    """`folder` as a transformers model folder whose every file this process may read; else FileNotFoundError
    (no config.json) or DataSourceError (naming the file it may not read)."""
    folder = Path(folder)
    check_readable(folder, "checkpoint=hf:<folder>")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is no transformers model folder: it has no config.json")
    for path in sorted(folder.iterdir()):
        check_readable(path, "checkpoint=hf:<folder>")
    return folder


def _dropout(config: PretrainedConfig) -> float:
    """The classifier head's dropout, by the names transformers models use for it."""
    for key in ("classifier_dropout", "hidden_dropout_prob", "hidden_dropout", "dropout"):
        value = getattr(config, key, None)
        if isinstance(value, int | float):
            return float(value)
    return 0.1


def load_hf_backbone(
    folder: str | Path, device: torch.device | str = "cpu", *, trust_remote_code: bool = False
) -> Backbone:
    """Wrap a local transformers folder (AutoModel or AutoModelForMaskedLM weights, tokenizer.json) as a Backbone.

    trust_remote_code: run modeling code shipped in the folder. Folders exported by cramming need it not.
    """
    folder = model_folder(folder)
    with naming(folder / "tokenizer.json"):
        tokenizer = load_tokenizer(folder)
    with naming(folder / "config.json"):
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    with naming(folder, "its weights"):
        model = _base_model(folder, config, trust_remote_code).float()
    pad_id = config.pad_token_id if getattr(config, "pad_token_id", None) is not None else None
    if pad_id is None:
        with naming(folder / "tokenizer_config.json"):
            pad_id = _special_token(folder, tokenizer, "pad", "[PAD]")
    if pad_id is None:
        raise ConfigError(f"{folder}: no pad token in config.json (pad_token_id) nor in the tokenizer")
    info = {
        "source": "transformers",
        "path": str(folder.resolve()),
        "model_type": config.model_type,
        "architectures": list(config.architectures or ()),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    return Backbone(
        encoder=HFEncoder(model).to(device),
        hidden_size=config.hidden_size,
        dropout=_dropout(config),
        tokenizer=tokenizer,
        pad_id=int(pad_id),
        info=info,
        max_positions=getattr(config, "max_position_embeddings", None),
    )


def load_hf_masked_lm(
    folder: str | Path, device: torch.device | str = "cpu", *, trust_remote_code: bool = False
) -> TransformersMaskedLM:
    """A local transformers masked LM (AutoModelForMaskedLM weights, tokenizer.json) for zero-shot scoring
    (BLiMP); its [MASK] id from the tokenizer files."""
    folder = model_folder(folder)
    with naming(folder / "tokenizer.json"):
        tokenizer = load_tokenizer(folder)
    with naming(folder, "its masked-LM weights"):
        model = AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=trust_remote_code).float()
    with naming(folder / "tokenizer_config.json"):
        mask_id = _special_token(folder, tokenizer, "mask", "[MASK]")
    if mask_id is None:
        raise ConfigError(f"{folder}: the tokenizer has no mask token ([MASK]): it cannot score by masking")
    return TransformersMaskedLM(model.to(device), tokenizer, mask_id)
