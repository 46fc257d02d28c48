"""Weight averaging: an exponential moving average (EMA) of a model's weights, taken after every applied update.

At short budgets and high learning rates, the average of the latest weights reaches a given loss sooner than
the weights themselves (Kaddour, "Stop Wasting My Time!", 2022, for BERT; Sanyal et al., "Early Weight
Averaging", 2023, for LLM pretraining), and it smooths out where in its last oscillations a run happens to
stop. The average is kept in fp32 beside the weights (4 bytes per parameter), and its decay warms up as
min(decay, (1 + t) / (10 + t)) after t updates, so that early on it follows the weights instead of remembering
the random initialization.
"""

from __future__ import annotations

import torch
from torch import nn

AVERAGES = ("none", "ema")


class WeightAverage:
    def __init__(self, model: nn.Module, decay: float):
        """decay: how much of the average each update keeps (its memory: about 1 / (1 - decay) updates)."""
        self.decay = decay
        self.params = [p for p in model.parameters() if p.requires_grad]  # a tied matrix once
        self.shadow = [p.detach().float().clone() for p in self.params]
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the weights after an applied update."""
        self.updates += 1
        keep = min(self.decay, (1 + self.updates) / (10 + self.updates))
        weights = [p.detach() if p.dtype == torch.float32 else p.detach().float() for p in self.params]
        torch._foreach_lerp_(self.shadow, weights, 1.0 - keep)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """The average becomes the model's weights (the final model of a run that averages)."""
        for param, averaged in zip(self.params, self.shadow, strict=True):
            param.copy_(averaged)

    def state_dict(self) -> dict:
        return {"updates": self.updates, "shadow": [tensor.clone() for tensor in self.shadow]}

    def load_state_dict(self, state: dict) -> None:
        self.updates = state["updates"]
        for mine, saved in zip(self.shadow, state["shadow"], strict=True):
            mine.copy_(saved)
