"""Compile the Triton kernels for Hopper (sm_90) without a GPU.

Triton's compiler and ptxas run on any machine, so every CI run proves the kernels *compile* for
the real target (the interpreter tests cannot: they never lower to PTX), and the register
report proves the production launch settings do not spill. Each kernel is specialised from the
argument values of a real launch with Triton's own launcher rule (divisibility by 16, constant 1),
so the code checked is the code a GPU runs. What runs fast on a GPU is for
bench/gpu.sh to show.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import tomllib
import torch

triton = pytest.importorskip("triton")
from normswap.kernels import triton_kernels as tk  # noqa: E402


def _pinned_triton() -> str | None:
    """The triton version pyproject's test extra pins (what CI installs)."""
    extra = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["test"]
    return next((spec.split("==", 1)[1] for spec in extra if spec.replace(" ", "").startswith("triton==")), None)


PINNED = _pinned_triton()


def _missing(what: str, *, module_level: bool = False):
    """Skip under another triton (its private API may have moved), but fail under the pinned one:
    there a missing piece is a broken test, not an unsupported setup."""
    if triton.__version__ == PINNED:
        pytest.fail(f"triton {PINNED} (pinned in pyproject's test extra): {what}", pytrace=False)
    pytest.skip(f"triton {triton.__version__} (pinned: {PINNED}): {what}", allow_module_level=module_level)


if tk.interpreter_active():
    pytest.skip("kernels are interpreter functions in this process", allow_module_level=True)
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:
    _missing(f"no ahead-of-time compile API ({e})", module_level=True)

try:
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import native_specialize_impl
except ImportError as e:
    _missing(f"no launch-time specialisation API ({e})", module_level=True)

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
TARGET = GPUTarget("cuda", 90, 32)
H100_SMS = 132
ROWS = 4096  # a prefill-sized batch: what a real launch passes (a multiple of 16, like most)


def launch_args(fn, h, dtype, rows=ROWS, *, has_w=True):
    """The values of ``fn``'s run-time arguments in a production launch of ``rows`` × ``h``
    contiguous rows (as triton_kernels.forward/backward pass them; pointers as aligned tensors)."""
    t = torch.empty(16, dtype=dtype)
    f32 = torch.empty(16, dtype=torch.float32)
    pointers = {"X": t, "R": t, "W": t, "Y": t, "S": t, "DY": t, "DX": t, "RSTD": f32, "DWP": f32}
    ints = {"n_rows": rows, "n_cols": h, "sx": h, "sr": h, "sy": h, "ss": h, "sdy": h, "sdx": h, "eps": 1e-5}
    if "rows_per_prog" in fn.arg_names:
        looped, block_m, _, _ = tk._settings(h, torch.device("cuda"), tk.MAX_FUSED_N, backward=True)
        block_m = 1 if looped else block_m
        programs = (
            max(1, min(tk.BWD_PROGRAMS_PER_SM * H100_SMS, triton.cdiv(rows, block_m)))
            if has_w
            else triton.cdiv(rows, block_m)
        )
        ints["rows_per_prog"] = triton.cdiv(triton.cdiv(rows, programs), block_m) * block_m
    return {**pointers, **ints}


def _specialise(fn, values, constexprs, divisibility=True):
    """Signature, constants and attributes exactly as Triton's launcher derives them from the
    argument values: pointers and integers divisible by 16 carry ``tt.divisibility=16`` (what lets
    the compiler vectorise loads), an integer equal to 1 becomes a constant."""
    backend = CUDABackend(TARGET)
    sig, consts, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        kind, spec = native_specialize_impl(backend, values[name], False, True, True)
        if kind == "constexpr":
            sig[name], consts[name] = "constexpr", spec
            continue
        sig[name] = kind
        if divisibility and spec:
            attrs[(i,)] = backend.parse_attr(spec)
    return sig, consts, attrs


def _compile(fn, dtype, constexprs, num_warps, *, h=None, rows=ROWS, divisibility=True):
    values = launch_args(
        fn, h if h is not None else constexprs["BLOCK_N"], dtype, rows, has_w=constexprs.get("HAS_W", True)
    )
    sig, consts, attrs = _specialise(fn, values, constexprs, divisibility)
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    try:
        return triton.compile(src, target=TARGET, options={"num_warps": num_warps})
    except Exception as e:  # e.g. no CUDA backend shipped with this triton build
        if "ptxas" in str(e) and not os.path.exists(os.path.join(BIN, "ptxas")):
            _missing(f"no ptxas: {e}")
        raise


def _resources(kernel) -> dict:
    tool = os.path.join(BIN, "cuobjdump")
    if not os.path.exists(tool):
        _missing("cuobjdump not shipped with this triton")
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
@pytest.mark.parametrize("h", [128, 384, 768, 4096, 8192, 16384, 32768])
def test_production_settings_compile_without_spills(h, backward):
    fn, consts, warps = _launch(h, torch.bfloat16, backward)
    res = _resources(_compile(fn, torch.bfloat16, consts, warps, h=h))
    assert res.get("STACK", 0) == 0 and res.get("LOCAL", 0) == 0, f"{fn.__name__} H={h} spills: {res}"
    assert res["REG"] <= 128, f"{fn.__name__} H={h}: {res['REG']} registers a thread limits occupancy"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_other_variants_compile(dtype):
    # H=1000 and an odd row count: the launch where no integer is divisible by 16
    for backward, has_w, has_r in [(False, False, False), (False, True, False), (True, False, False)]:
        fn, consts, warps = _launch(1000, dtype, backward, has_w=has_w, has_r=has_r)
        assert _compile(fn, dtype, consts, warps, h=1000, rows=999).asm["ptx"]


def test_specialisation_is_what_the_launcher_uses():
    """The compiled kernel is the one a launch runs: divisibility reaches the IR and vectorises the
    loads (negative control: without it the same kernel loads element by element or in pairs)."""
    fn, consts, warps = _launch(4096, torch.bfloat16, False)
    values = launch_args(fn, 4096, torch.bfloat16)
    sig, _, attrs = _specialise(fn, values, consts)
    assert sig["n_cols"] == "i32" and [["tt.divisibility", 16]] in attrs.values()
    assert (fn.arg_names.index("n_cols"),) in attrs and (fn.arg_names.index("X"),) in attrs
    with_div = _compile(fn, torch.bfloat16, consts, warps, h=4096)
    without = _compile(fn, torch.bfloat16, consts, warps, h=4096, divisibility=False)
    assert "tt.divisibility = 16" in with_div.asm["ttir"] and "tt.divisibility" not in without.asm["ttir"]
    wide = re.compile(r"ld\.global(\.\w+)*\.v4\.b32")
    assert wide.search(with_div.asm["ptx"]) and not wide.search(without.asm["ptx"])


def test_spill_check_can_fail():
    """Negative control: the old backward setting (8 warps for a 8192-wide bf16 row) is caught."""
    res = _resources(
        _compile(tk._bwd_fused, torch.bfloat16, {"HAS_W": True, "BLOCK_M": 1, "BLOCK_N": 8192, "RNE_FIX": False}, 8)
    )
    assert res["REG"] > 128
