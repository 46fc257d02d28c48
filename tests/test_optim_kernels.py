"""The fused 8-bit AdamW kernel (cramming.kernels.adamw8bit) against its PyTorch reference.

On CPU the kernel runs in the Triton interpreter; TRITON_INTERPRET must be set before the kernel module is
imported (tests/conftest.py does it too). On a GPU the `gpu`-marked tests run the compiled kernel.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cramming.kernels.adamw8bit import adamw8bit_update_triton  # noqa: E402
from cramming.optim import AdamW  # noqa: E402
from cramming.optim.lowbit import AdamScalars, QuantizedMoments, adamw8bit_update_torch  # noqa: E402
from cramming.optim.quant import SECOND_MOMENT_MAPS, first_moment_map, second_moment_map  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
FP32_EPS = torch.finfo(torch.float32).eps
# Both paths do the same fp32 operations in the same order, so they differ only where one rounds a product
# differently (the interpreter takes the scalars as fp64; a GPU may contract mul+add despite the flag).
# The update term step_size·m/denom is a chain of about eight roundings, so allow UPDATE_ULPS of it plus
# one ulp of the parameter in fp32, and one ulp of the parameter's own dtype (the interpreter stores
# fp32 -> bf16 by truncation, not round-to-nearest).
UPDATE_ULPS = 8
STORE_ULP = {torch.float32: 0.0, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def _clone(st: QuantizedMoments) -> QuantizedMoments:
    return QuantizedMoments(st.m_codes.clone(), st.m_absmax.clone(), st.v_codes.clone(), st.v_absmax.clone())


def _assert_params_close(p_ker, p_ref, p_before, decay, dtype, step) -> None:
    ref, ker = p_ref.float(), p_ker.float()
    update = (p_before.float() * decay - ref).abs()
    allowed = FP32_EPS * (UPDATE_ULPS * update + ref.abs()) + STORE_ULP[dtype] * ref.abs()
    # below the smallest normal of the dtype the ulp is fixed
    allowed = allowed + torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    excess = (ker - ref).abs() - allowed
    worst = int(excess.argmax())
    assert excess.max().item() <= 0, (
        f"step {step}: index {worst} of {ref.numel()}: kernel {ker[worst].item()!r}, reference "
        f"{ref[worst].item()!r}, update {update[worst].item():.3g}, allowed {allowed[worst].item():.3g}; "
        f"{int((excess > 0).sum())} elements off"
    )


def _compare(
    device: str, numel: int, dtype: torch.dtype, v_map_name: str = "nonzero", steps: int = 3
) -> None:
    """Each step starts both paths from the kernel's state, so that a last-bit difference cannot grow."""
    m_map, v_map = first_moment_map(8, device), second_moment_map(v_map_name, device)
    sqrt_v = SECOND_MOMENT_MAPS[v_map_name].sqrt
    p_ker = (torch.randn(numel, device=device) * 0.1).to(dtype)
    st_ker = QuantizedMoments.zeros(numel, torch.device(device))
    for t in range(1, steps + 1):
        g = (torch.randn(numel, device=device) * torch.logspace(-4, 0, numel, device=device)).to(dtype)
        if t == 2 and numel > 3:  # skipped elements: parameter and moments keep their values
            g[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
        s = AdamScalars.at_step(t, lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)
        p_ref, st_ref = p_ker.clone(), _clone(st_ker)
        adamw8bit_update_torch(p_ref, g, st_ref, m_map, v_map, s, sqrt_v=sqrt_v)
        p_before = p_ker.clone()
        adamw8bit_update_triton(
            p_ker,
            g,
            st_ker.m_codes,
            st_ker.m_absmax,
            st_ker.v_codes,
            st_ker.v_absmax,
            m_map.code,
            v_map.code,
            **dataclasses.asdict(s),
            sqrt_v=sqrt_v,
        )
        for name in ("m_codes", "v_codes"):
            diff = (getattr(st_ref, name).int() - getattr(st_ker, name).int()).abs()
            where = int(diff.argmax())
            assert diff.max().item() <= 1, (
                f"step {t}, {name}: index {where} differs by {diff.max().item()} codes "
                f"(ref {getattr(st_ref, name)[where].item()}, kernel {getattr(st_ker, name)[where].item()})"
            )
            # a one-code difference is a tie broken differently after a last-bit rounding difference: rare
            assert (diff > 0).float().mean().item() < 0.01, (
                f"step {t}, {name}: {(diff > 0).sum().item()} codes differ"
            )
        torch.testing.assert_close(st_ker.m_absmax, st_ref.m_absmax, rtol=1e-6, atol=0)
        torch.testing.assert_close(st_ker.v_absmax, st_ref.v_absmax, rtol=1e-6, atol=0)
        _assert_params_close(p_ker, p_ref, p_before, s.decay, dtype, t)
        if t == 2 and numel > 3:
            assert torch.equal(p_ker[:3], p_before[:3]), "non-finite gradient elements must be skipped"


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 before triton is first imported")
@pytest.mark.parametrize("numel", [1, 7, 256, 1000, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_kernel_matches_reference_interpreted(numel, dtype):
    _compare("cpu", numel, dtype)


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 before triton is first imported")
@pytest.mark.parametrize("v_map_name", sorted(SECOND_MOMENT_MAPS))
def test_kernel_matches_reference_every_second_moment_map(v_map_name):
    _compare("cpu", 1000, torch.float32, v_map_name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("numel", [1, 1000, 4099, 1 << 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("v_map_name", sorted(SECOND_MOMENT_MAPS))
def test_kernel_matches_reference_cuda(numel, dtype, v_map_name):
    if INTERPRETED:
        pytest.skip("TRITON_INTERPRET is set: this would run the interpreter, not the compiled kernel")
    _compare("cuda", numel, dtype, v_map_name)


@pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(), reason="no Triton backend here")
def test_optimizer_with_kernel_tracks_torch_path():
    """The whole optimizer, fused vs PyTorch, on a small model: same parameters after 5 steps."""
    device = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
    model = nn.Sequential(nn.Linear(96, 64), nn.GELU(), nn.Linear(64, 8)).to(device)
    twin = nn.Sequential(nn.Linear(96, 64), nn.GELU(), nn.Linear(64, 8)).to(device)
    twin.load_state_dict(model.state_dict())
    optims = [
        AdamW(m.parameters(), lr=1e-2, optim_bits=8, min_8bit_size=512, kernel=k)
        for m, k in ((model, "triton"), (twin, "torch"))
    ]
    x, y = torch.randn(32, 96, device=device), torch.randn(32, 8, device=device)
    for _ in range(5):
        for m, opt in zip((model, twin), optims, strict=True):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    assert "m_codes" in optims[0].state[model[0].weight], "the 96x64 weight should have 8-bit state"
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


_COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cramming.kernels.adamw8bit import _adamw8bit_update_kernel

for dtype in ("fp32", "bf16"):
    sig = {name: "*fp32" for name in ("m_absmax_ptr", "v_absmax_ptr", "m_map_ptr", "v_map_ptr")}
    sig.update({"param_ptr": f"*{dtype}", "grad_ptr": f"*{dtype}", "m_codes_ptr": "*u8", "v_codes_ptr": "*u8"})
    sig.update({"n": "i32", "QBLOCK": "constexpr", "BLOCKS_PER_PROGRAM": "constexpr", "SQRT_V": "constexpr"})
    for name in ("beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "decay", "step_size", "bias2_sqrt"):
        sig[name] = "fp32"
    order = list(_adamw8bit_update_kernel.arg_names)
    src = ASTSource(
        fn=_adamw8bit_update_kernel,
        signature={name: sig[name] for name in order},
        constexprs={"QBLOCK": 256, "BLOCKS_PER_PROGRAM": 4, "SQRT_V": False},
    )
    options = {"num_warps": 4, "enable_fp_fusion": False}
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm["cubin"], "no cubin"
    assert "fma.rn" not in compiled.asm["ptx"], "fp fusion should be off"
print("ok")
"""


def test_kernel_compiles_for_hopper_without_a_gpu():
    """Compile (not run) the kernel for sm_90 with the installed triton: catches API breaks of the
    compiled path on machines without a GPU."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this triton has no NVIDIA backend")
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # the interpreter would replace the JIT function
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    if "ptxas" in result.stderr and "not found" in result.stderr.lower():
        pytest.skip("ptxas is not available to this triton")
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
