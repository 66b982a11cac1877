"""Which implementation computes each arm's norms, in which dtype, and what it really is.

Three jobs, each done once here and used by arms.py (building), interleaved.py (observing one real
step) and the throughput analysis (the kernel speed-up behind the Amdahl bound):

* **Choosing** (``--kernels``). RMSNorm has several implementations; LayerNorm has one worth
  running, PyTorch's fused ``F.layer_norm`` (one ATen kernel forward and backward on CPU and
  CUDA). ``torch`` runs every RMSNorm through ``F.rms_norm``; ``normswap`` through normswap's own
  module (what normswap.kernels' chooser runs: its fused C++ kernel on CPU, Triton on CUDA, as
  measured); ``best`` (the default) asks that same chooser (normswap.kernels.choose) for the arm's
  own kind of call (rows = batch × sequence, width, the dtype the norms compute in, a gradient)
  before any training step: ``torch`` where it picks torch's own ``F.rms_norm``, else
  ``normswap``. Where the chooser's compile rule says compiling pays (CUDA), ``compile``
  (``torch.compile`` of the RMSNorm formula, Inductor) is a candidate too, taken when the
  side-by-side timing (normswap.timing, forward and backward) finds it faster; on CPU compiling
  takes tens of seconds a shape on a 2-core machine and normswap's C++ kernel is already one pass.
  Each implementation is a record of normswap.kernels' one table (``native``, ``compiled``, or none:
  the chooser's decision), run by normswap's RMSNorm module by name (``RMSNorm.backend``).
* **Low precision** (``--precision bf16|fp16``). Under autocast alone the norms receive the fp32
  residual stream and return fp32 (layer_norm computes in its input's dtype, and autocast leaves
  it alone or puts it in fp32), so no norm would run in low precision. :func:`compute_in` makes
  every norm of the model compute in the training dtype: its input, γ and β are cast to that
  dtype (differentiably: the fp32 master weights get their gradients), autocast is switched off
  inside, and the output stays in that dtype.
* **Labelling, detected.** :func:`observe` hooks every norm for one real training step and
  records, from what happened: the output's dtype (``norm_compute_dtype``), and the autograd
  nodes between the norm's output and its inputs (casts of the inputs and weights not counted):
  one node is one kernel forward and backward (fused); more is a composite of separate ops.
  ``norm_kernel`` names the implementation and what the graph showed, e.g.
  ``torch.nn.functional.rms_norm (composite: 6 autograd nodes, grad_fn MulBackward0)``.
"""

from __future__ import annotations

import functools

import torch

from normswap import timing
from normswap.kernels import choose
from normswap.model_facts import hidden_size_of, norm_modules
from normswap.modules import RMSNorm

CHOICES = ("best", "torch", "normswap")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BENCH_REPEATS = 30  # interleaved pairs of the side-by-side microbenchmark
BENCH_WARMUP = 3
BENCH_BUDGET_S = 10.0  # at most this long for one side-by-side timing


# the study's RMSNorm implementations, each a record of normswap.kernels' one table, run by the
# module it names (normswap.modules.RMSNorm.backend): ``normswap`` is what the chooser decides per
# kind of call, ``torch`` torch's own F.rms_norm, ``compile`` torch.compile of the formula
RMS_IMPLS = {"normswap": None, "torch": "native", "compile": "compiled"}
# what each implementation is called in a label (the detected structure is added to it)
RECORD_NAMES = {
    None: "normswap rms_norm",
    "native": "torch.nn.functional.rms_norm",
    "compiled": "torch.compile(rms_norm)",
}
IMPL_NAMES = {torch.nn.LayerNorm: "torch.nn.functional.layer_norm"}
# what a single autograd node says about the kernel behind it (substring of its name())
NODE_KERNELS = (
    ("NativeLayerNormBackward", "aten native_layer_norm"),
    ("normswap_cpu", "normswap cpu fused kernel"),
    ("_EagerRMSNorm", "normswap triton kernel"),
    ("normswap", "normswap custom op"),
    ("CompiledFunction", "Inductor kernel"),
    ("FusedRmsNorm", "aten _fused_rms_norm"),
)


def candidates(device) -> list[str]:
    """The RMSNorm implementations ``--kernels best`` times on this device: ``compile`` only where
    normswap.kernels' compile rule says compiling pays (see the module doc)."""
    return ["normswap", "torch"] + (["compile"] if choose.compile_pays(device) else [])


def use_rms_impl(model: torch.nn.Module, impl: str) -> int:
    """Make every RMSNorm of ``model`` compute with ``impl``'s record (same module, same parameters);
    how many changed."""
    n = 0
    for _, m in model.named_modules():
        if isinstance(m, RMSNorm):
            m.backend = RMS_IMPLS[impl]
            m.unbind()
            n += 1
    return n


# ---------------------------------------------------------------------------- low precision
class _ComputeIn:
    """Mixin: the norm's forward with its input, γ and β in ``_compute_dtype`` and autocast off."""

    _compute_dtype = torch.float32

    def forward(self, *args, **kwargs):
        dt = self._compute_dtype

        def cast(a):
            return a.to(dt) if torch.is_tensor(a) and a.is_floating_point() else a

        args = tuple(cast(a) for a in args)
        kwargs = {k: cast(v) for k, v in kwargs.items()}
        saved = self._parameters
        # the parameters as this dtype for this call only: the fp32 masters stay the module's
        object.__setattr__(self, "_parameters", {k: cast(v) for k, v in saved.items()})
        device_type = next((a.device.type for a in args if torch.is_tensor(a)), "cpu")
        try:
            with torch.autocast(device_type=device_type, enabled=False):
                return super().forward(*args, **kwargs)
        finally:
            object.__setattr__(self, "_parameters", saved)


@functools.cache
def _low_precision_class(cls: type, dtype: torch.dtype) -> type:
    # the dtype goes in front: model_facts.norm_kind reads a class's name by its ending (…Norm,
    # …LayerNorm), and a DyTNorm renamed DyTNormInBfloat16 would stop being a norm
    name = f"{DTYPE_NAMES[dtype].capitalize()}{cls.__name__}"
    return type(name, (_ComputeIn, cls), {"_compute_dtype": dtype, "__module__": __name__})


def base_class(module: torch.nn.Module) -> type:
    """The norm's own class (the low-precision wrapper's base)."""
    cls = type(module)
    return cls.__mro__[2] if issubclass(cls, _ComputeIn) else cls


def compute_in(model: torch.nn.Module, precision: str) -> int:
    """Make every norm of ``model`` compute in ``precision``'s dtype (fp32: nothing changes)."""
    dtype = PRECISION_DTYPES[precision]
    if dtype == torch.float32:
        return 0
    norms = norm_modules(model)
    for _, m in norms:
        m.__class__ = _low_precision_class(base_class(m), dtype)
    return len(norms)


# ---------------------------------------------------------------------------- labels, detected
# autograd nodes that launch no arithmetic kernel: dtype casts (the low-precision wrapper's) and views
NOT_COMPUTE = ("ToCopyBackward", "ViewBackward", "UnsafeViewBackward", "ReshapeAlias", "AliasBackward")


def _kernel_nodes(out: torch.Tensor, inputs: list[torch.Tensor]) -> list[str]:
    """Names of the autograd nodes between ``out`` and the norm's inputs and parameters, casts and
    views (NOT_COMPUTE) not counted: what computes the norm, forward and backward."""
    stop = {t.grad_fn for t in inputs if torch.is_tensor(t) and t.grad_fn is not None}
    seen, names, todo = set(), [], [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in stop or id(node) in seen:
            continue
        seen.add(id(node))
        name = node.name()
        if name.endswith("AccumulateGrad"):
            continue
        if not name.startswith(NOT_COMPUTE):
            names.append(name)
        todo.extend(n for n, _ in node.next_functions)
    return names


def describe(module: torch.nn.Module, nodes: list[str]) -> tuple[str, bool]:
    """``(label, fused)`` of a norm from the autograd nodes it produced (see :func:`_kernel_nodes`)."""
    cls = base_class(module)
    if issubclass(cls, RMSNorm):
        impl = RECORD_NAMES.get(module.backend, f"normswap rms_norm ({module.backend})")
    else:
        impl = next((v for k, v in IMPL_NAMES.items() if cls is k), None)
    if impl is None:
        impl = next((v for k, v in IMPL_NAMES.items() if issubclass(cls, k)), f"{cls.__module__}.{cls.__qualname__}")
    if not nodes:
        return f"{impl} (no gradient: structure not seen)", False
    top = nodes[0]
    fused = len(nodes) == 1
    if fused:
        what = next((v for k, v in NODE_KERNELS if k in top), "one op")
        return f"{impl} (fused: {what}, grad_fn {top})", True
    return f"{impl} (composite: {len(nodes)} autograd nodes, grad_fn {top})", False


class observe:
    """Context: forward hooks on every norm of ``model`` for one real step. Afterwards
    :meth:`summary` gives ``norm_kernel``, ``norm_kernel_fused`` and ``norm_compute_dtype``."""

    def __init__(self, model: torch.nn.Module):
        self.norms = norm_modules(model)
        self.seen: list[tuple[str, bool, str]] = []
        self._handles = []

    def _hook(self, module, args, kwargs, out):
        y = out[0] if isinstance(out, tuple) else out
        if not torch.is_tensor(y):
            return
        inputs = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
        nodes = _kernel_nodes(y, inputs) if y.requires_grad else []
        label, fused = describe(module, nodes)
        self.seen.append((label, fused, DTYPE_NAMES.get(y.dtype, str(y.dtype).replace("torch.", ""))))

    def __enter__(self):
        self._handles = [m.register_forward_hook(self._hook, with_kwargs=True) for _, m in self.norms]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        return False

    def summary(self) -> dict:
        """One label per distinct kind of norm (joined with " + "); fused only when every norm is;
        the dtype the norms returned ("mixed: …" when they differ)."""
        if not self.seen:
            return {"norm_kernel": None, "norm_kernel_fused": None, "norm_compute_dtype": None}
        labels = list(dict.fromkeys(s[0] for s in self.seen))
        dtypes = list(dict.fromkeys(s[2] for s in self.seen))
        return {
            "norm_kernel": " + ".join(labels),
            "norm_kernel_fused": all(s[1] for s in self.seen),
            "norm_compute_dtype": dtypes[0] if len(dtypes) == 1 else "mixed: " + ", ".join(dtypes),
        }


# ---------------------------------------------------------------------------- side-by-side timing
def time_side_by_side(
    modules: dict, rows: int, device, *, baseline: str | None = None, seed: int = 0, budget_s: float = BENCH_BUDGET_S
) -> dict:
    """One forward + backward of each norm module on the same fp32 input (rows × width, as the
    residual stream reaches the norms), timed by normswap's one instrument (normswap.timing.compare:
    interleaved pairs against ``baseline``, the first module by default). ``{"seconds": {name: median
    s a call}, "speed": {name: baseline's seconds ÷ its own, per pair, median}, "errors"?}``; a module
    that fails before timing is left out (its error under ``"errors"``)."""
    device = torch.device(device)
    width = hidden_size_of(next(iter(modules.values())))
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(rows, width, generator=g).to(device)
    dy = torch.randn(rows, width, generator=g).to(device)

    def step(m):
        def once():
            x = x0.detach().requires_grad_(True)
            y = m(x)
            y = y[0] if isinstance(y, tuple) else y
            y.backward(dy.to(y.dtype))

        return once

    fns, errors = {}, {}
    for name, m in modules.items():
        try:  # a candidate that cannot run here (e.g. no compiler) is not timed
            step(m)()
            fns[name] = step(m)
        except Exception as e:  # noqa: BLE001
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    out: dict = {"seconds": {}, "speed": {}}
    if fns:
        base = baseline if baseline in fns else next(iter(fns))
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
        cmp = timing.compare(
            fns, base, None, calls_per_sample=1, budget_s=budget_s, min_pairs=BENCH_REPEATS,
            max_pairs=BENCH_REPEATS, warmup=BENCH_WARMUP, sync=sync,
        )  # fmt: skip
        out["seconds"] = dict(cmp.seconds_per_call)
        out["speed"] = {name: r.ratio for name, r in cmp.candidates.items()}
    if errors:
        out["errors"] = errors
    return out


def _sample_rms(like: torch.nn.Module, impl: str, device, precision: str) -> torch.nn.Module:
    """A fresh RMSNorm like ``like`` (width, ε, bias) computing with ``impl`` in ``precision``."""
    m = RMSNorm(like.hidden_size, like.eps, bias=like.bias is not None).to(device)
    holder = torch.nn.Sequential(m)
    use_rms_impl(holder, impl)
    compute_in(holder, precision)
    return holder[0]


def kernels_pick(like: torch.nn.Module, rows: int, device, precision: str) -> str:
    """What normswap.kernels' chooser runs for the arm's norm calls (a training step: γ, a gradient,
    rows × width in the dtype the norms compute in), as a study implementation: ``torch`` where it
    chooses torch's own ``F.rms_norm`` (``native``), else ``normswap`` (the module runs its choice)."""
    dtype = PRECISION_DTYPES[precision]
    x = torch.empty(rows, like.hidden_size, device=device, dtype=dtype, requires_grad=True)
    weight = torch.empty(like.hidden_size, device=device, dtype=dtype, requires_grad=True)
    bias = weight if like.bias is not None else None
    with torch.enable_grad():
        kind = choose.call_kind(x, weight, bias)
    return "torch" if choose.decide(kind, rows=rows).name == RMS_IMPLS["torch"] else "normswap"


def choose_rms(like: torch.nn.Module, rows: int, device, precision: str) -> dict:
    """``--kernels best``: the RMSNorm implementation normswap.kernels' chooser picks for this shape,
    device and dtype (:func:`kernels_pick`); where compiling pays (the chooser's compile rule,
    ``choose.compile_pays``: CUDA), ``torch.compile`` of the formula replaces it when the side-by-side
    timing finds it faster. ``{"choice", "chooser", "seconds": {impl: median s}, "candidates", ...}``."""
    picked = kernels_pick(like, rows, device, precision)
    cands = candidates(device)
    mods = {c: _sample_rms(like, c, device, precision) for c in cands}
    timed = time_side_by_side(mods, rows, device, baseline=picked)
    choice = picked if picked in timed["seconds"] else next(iter(timed["seconds"]), "normswap")
    if "compile" in timed["speed"] and timed["speed"]["compile"] > 1 and choice == picked:
        choice = "compile"
    out = {
        "choice": choice,
        "chooser": picked,
        "seconds": timed["seconds"],
        "candidates": cands,
        "rows": rows,
        "width": like.hidden_size,
    }
    if timed.get("errors"):
        out["errors"] = timed["errors"]
    return out


def first_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    norms = norm_modules(model)
    return norms[0][1] if norms else None


def kernel_speedup(arm_norm: torch.nn.Module, base_norm: torch.nn.Module, rows: int, device) -> dict:
    """The arm's norm against the baseline's, side by side (forward + backward, normswap.timing):
    ``speedup`` = the median over pairs of baseline seconds / arm seconds (> 1: the arm's norm is
    faster); ``seconds``: each one's median."""
    import copy

    mods = {"baseline": copy.deepcopy(base_norm).to(device), "arm": copy.deepcopy(arm_norm).to(device)}
    timed = time_side_by_side(mods, rows, device, baseline="baseline")
    secs = dict(timed["seconds"])
    if timed.get("errors"):
        secs["errors"] = timed["errors"]
    return {"speedup": timed["speed"].get("arm"), "seconds": secs, "rows": rows}


def rms_impl_of(choice: str, auto: dict | None) -> str:
    """The implementation an arm runs for ``--kernels choice`` (``best``: what :func:`choose_rms` chose)."""
    if choice == "best":
        return (auto or {}).get("choice", "normswap")
    return choice


def setup(build, arms: list[str], baseline: str, option: str, device, precision: str, rows: int) -> dict:
    """The study's kernel set-up, measured before any training step: the RMSNorm implementation
    (``--kernels best``: the side-by-side choice), and each arm's norm against the baseline's,
    side by side on the training shape (the kernel speed-up of the Amdahl bound).
    ``build(arm, rms_impl)`` builds seed 0's arm."""
    device = torch.device(device)
    out: dict = {"option": option, "rows": rows, "device": str(device), "precision": precision}
    rms_like = None
    for arm in arms:
        if arm == baseline:
            continue
        norm = first_norm(build(arm, "normswap"))
        if norm is not None and isinstance(norm, RMSNorm):
            rms_like = norm
            break
    if option == "best" and rms_like is not None:
        out["best"] = choose_rms(rms_like, rows, device, precision)
        out["rms_impl"] = out["best"]["choice"]
    else:
        out["rms_impl"] = rms_impl_of(option, None)
    base_norm = first_norm(build(baseline, out["rms_impl"]))
    out["speedup"] = {}
    for arm in arms:
        if arm == baseline:
            continue
        norm = first_norm(build(arm, out["rms_impl"]))
        if norm is not None and base_norm is not None:
            out["speedup"][arm] = kernel_speedup(norm, base_norm, rows, device)
    out["method"] = (
        f"one norm of each arm (its first), forward + backward on a {rows} × width fp32 input, "
        f"median of {BENCH_REPEATS} interleaved pairs after {BENCH_WARMUP} warm-up blocks (normswap.timing.compare)"
    )
    return out
