"""Pretraining with only one of adamw_4bit's two moments in 4 bits, the other in fp32: which moment costs
held-out loss at equal updates (results/optimizers/, "4-bit: does it fall behind, and why").

    python scripts/studies/diag_4bit_moments.py first  +sweep=cpu-study arch=bert-tiny train/optim=adamw_4bit ...
    python scripts/studies/diag_4bit_moments.py second +sweep=cpu-study arch=bert-tiny train/optim=adamw_4bit ...

`first` keeps the first moment in adamw_4bit's 4-bit format (block, round to nearest) and the second in fp32;
`second` the reverse. Everything after the first word goes to pretrain.py as Hydra overrides. The fp32 moment
lives in an extra state tensor (`diag_m` or `diag_v`), so the state bytes the run reports are not adamw_4bit's:
this is a diagnostic, not an optimizer to use. The 4-bit codes of the fp32 moment stay zero and unused.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch

from cramming.optim import adamw as adamw_module
from cramming.optim.lowbit import (
    adamw_step,
    decode_m4,
    decode_v4,
    encode_m4,
    encode_v4,
    fp32_work,
)
from cramming.optim.quant import rank1_shape

REPO = Path(__file__).resolve().parents[2]

QUANTIZED = ("first", "second")


def one_moment_update(quantized: str):
    """An adamw4bit_update_torch with only the `quantized` moment in 4 bits."""

    def update(param, grad, state, maps, s, stochastic_step=None, normalized=False) -> None:
        if stochastic_step is not None or normalized:
            raise SystemExit("diag_4bit_moments: use the default 4-bit settings (nearest, block)")
        n = param.numel()
        matrix = rank1_shape(tuple(param.shape))
        g = grad.detach().reshape(-1).float()
        p, aliased = fp32_work(param, None)
        keep = "diag_v" if quantized == "first" else "diag_m"
        if keep not in state:
            state[keep] = torch.zeros(n, dtype=torch.float32, device=param.device)
        if quantized == "first":
            v = state["diag_v"]
            m = decode_m4(state, n, maps, v, False)
        else:
            v = decode_v4(state, n, matrix, maps)
            m = state["diag_m"]
        adamw_step(p, g, m, v, s)  # in place on m and v: the fp32 one is updated where it is kept
        if not aliased:
            param.detach().copy_(p.view(param.shape))
        if quantized == "first":
            encode_m4(m, state, maps, v, False, None)
        else:
            encode_v4(v, state, matrix, maps)

    return update


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in QUANTIZED:
        raise SystemExit(f"usage: diag_4bit_moments.py {{{'|'.join(QUANTIZED)}}} <pretrain.py overrides>")
    quantized = sys.argv.pop(1)
    adamw_module.adamw4bit_update_torch = one_moment_update(quantized)
    print(f"diag_4bit_moments: only the {quantized} moment of adamw_4bit is in 4 bits", flush=True)
    # pretrain.py as the main script, so that Hydra finds conf/ beside it; the patch above is in place
    runpy.run_path(str(REPO / "pretrain.py"), run_name="__main__")


if __name__ == "__main__":
    main()
