"""Compile the Triton kernels for Hopper (sm_90) without a GPU.

Triton's compiler and ptxas run on any machine, so every CI run proves the kernels *compile* for
the real target (the interpreter tests cannot: they never lower to PTX), and the register
report proves the production launch settings do not spill. What runs fast on a GPU is for
bench/gpu.sh to show.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest
import torch

triton = pytest.importorskip("triton")
from normswap.kernels import triton_kernels as tk  # noqa: E402

if tk.interpreter_active():
    pytest.skip("kernels are interpreter functions in this process", allow_module_level=True)
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - older triton
    pytest.skip("this triton has no ahead-of-time compile API", allow_module_level=True)

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
POINTERS = {"X", "R", "W", "Y", "S", "DY", "DX"}
TL = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _compile(fn, dtype, constexprs, num_warps):
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in POINTERS:
            sig[name] = f"*{TL[dtype]}"
        elif name in ("RSTD", "DWP"):
            sig[name] = "*fp32"
        elif name == "eps":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    except Exception as e:  # e.g. no CUDA backend shipped with this triton build
        if "ptxas" in str(e) and not os.path.exists(os.path.join(BIN, "ptxas")):
            pytest.skip(f"no ptxas: {e}")
        raise


def _resources(kernel) -> dict:
    tool = os.path.join(BIN, "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip("cuobjdump not shipped with this triton")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", out)}


def _launch(h, dtype, backward, has_w=True, has_r=True):
    looped, block_m, block_n, warps = tk._settings(h, torch.device("cuda"), tk.MAX_FUSED_N, backward=backward)
    if backward:
        fn = tk._bwd_looped if looped else tk._bwd_fused
        consts = {"HAS_W": has_w, "BLOCK_N": block_n, "RNE_FIX": False}
    else:
        fn = tk._fwd_looped if looped else tk._fwd_fused
        consts = {"HAS_W": has_w, "HAS_R": has_r, "BLOCK_N": block_n, "RNE_FIX": False}
    if not looped:
        consts["BLOCK_M"] = block_m
    return fn, consts, warps


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("h", [768, 4096, 8192, 16384, 32768])
def test_production_settings_compile_without_spills(h, backward):
    fn, consts, warps = _launch(h, torch.bfloat16, backward)
    res = _resources(_compile(fn, torch.bfloat16, consts, warps))
    assert res.get("STACK", 0) == 0 and res.get("LOCAL", 0) == 0, f"{fn.__name__} H={h} spills: {res}"
    assert res["REG"] <= 128, f"{fn.__name__} H={h}: {res['REG']} registers a thread limits occupancy"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_other_variants_compile(dtype):
    for backward, has_w, has_r in [(False, False, False), (False, True, False), (True, False, False)]:
        fn, consts, warps = _launch(1000, dtype, backward, has_w=has_w, has_r=has_r)
        assert _compile(fn, dtype, consts, warps).asm["ptx"]


def test_spill_check_can_fail():
    """Negative control: the old backward setting (8 warps for a 8192-wide bf16 row) is caught."""
    res = _resources(_compile(tk._bwd_fused, torch.bfloat16, {"HAS_W": True, "BLOCK_M": 1, "BLOCK_N": 8192, "RNE_FIX": False}, 8))
    assert res["REG"] > 128
