"""What a training step measures besides its loss and global gradient norm — none of it in a timed step.

Every step of a unit has one role (:class:`StepPlan`), the same for every arm:

* ``first`` (step 1): AdamW allocates its moments, kernels warm up; the norms' kernels and dtypes
  are observed (study/training/norm_impl.py ``observe``: labels detected from the autograd graph).
* ``memory`` (step 2): the steady-state peak (:class:`PeakMemory`), AdamW's state already there,
  so it is counted once, in ``static_bytes``.
* ``profile`` (``PROFILE_SAMPLES`` steps spread evenly from step 3, at most one in ``PROFILE_EVERY``):
  the norms' share of the step
  (:class:`NormTimer`: synchronising hooks around every norm's forward and backward) and the
  gradient norm arriving at each norm's input (:class:`NormInputGrads`), accumulated on the
  device and read once after the step. Over many steps, spread through training, not one.
* ``timed``: every other step. Nothing is hooked: the step's wall time is all that is taken.

Arm order within a step (:meth:`StepPlan.order`): a Williams design — rows of a balanced Latin
square, in which every arm runs first equally often and directly after every other arm equally
often — walked over the timed steps, so no arm always follows another (or the data loading).

``peak memory`` (one method for every arm, documented in results ``setup.memory_method``):
    static_bytes = the arm's parameters + optimizer state (resident for the whole run)
    transient_bytes = the highest allocation during the step above what was allocated before it
    peak_bytes = static_bytes + transient_bytes
where "allocated" is, on CUDA, ``torch.cuda.memory_allocated`` with ``max_memory_allocated``
after ``reset_peak_memory_stats``; on CPU the same quantity counted in Python: the bytes of the
tensor storages the step's ATen ops allocated and have not freed, summed after every op through a
dispatch mode (:class:`_StoragePeak`; what the C allocator rounds up or keeps for itself is not in it).
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from normswap.host import load_average as host_load_average

FIRST, MEMORY, PROFILE, TIMED = "first", "memory", "profile", "timed"
MEMORY_STEP = 2
PROFILE_START = 3
PROFILE_EVERY = 5  # at most one step in five profiled
# profiled steps per unit: the norms' share and the norm-input gradients are sampled on this many
# steps spread over the run, not measured on every step — their synchronising hooks cost more than
# the norms themselves, and a few samples give the share to the precision the Amdahl bound needs
PROFILE_SAMPLES = 8


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------- the plan of steps
def williams_rows(n: int) -> list[list[int]]:
    """A Williams design for n treatments: rows (orders) in which each treatment is first equally
    often and each ordered pair (a directly before b) occurs equally often. n rows for even n, 2n
    for odd n (the rows and their reverses)."""
    if n <= 1:
        return [list(range(n))]
    base, lo, hi = [0], 1, n - 1
    while len(base) < n:  # 0, 1, n−1, 2, n−2, …
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    rows = [[(b + r) % n for b in base] for r in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


class StepPlan:
    """Each step's role and arm order, from the number of steps and the arms of the group."""

    def __init__(self, steps: int, arm_names: list[str]):
        self.steps = steps
        self.arm_names = list(arm_names)
        self.rows = williams_rows(len(arm_names))
        self.profile_every = max(PROFILE_EVERY, (steps - PROFILE_START) // PROFILE_SAMPLES + 1)

    def role(self, t: int) -> str:
        if t == 1:
            return FIRST
        if t == MEMORY_STEP:
            return MEMORY
        if t >= PROFILE_START and (t - PROFILE_START) % self.profile_every == 0:
            return PROFILE
        return TIMED

    def profiled_steps(self) -> list[int]:
        return [t for t in range(1, self.steps + 1) if self.role(t) == PROFILE]

    def timed_index(self, t: int) -> int:
        """How many timed steps come before step t (the Williams rows are walked over timed steps)."""
        return sum(1 for s in range(1, t) if self.role(s) == TIMED)

    def order(self, t: int, active: list) -> list:
        """``active`` (objects with ``.name``) in step t's Williams order; stopped arms dropped."""
        row = self.rows[self.timed_index(t) % len(self.rows)]
        rank = {self.arm_names[i]: k for k, i in enumerate(row)}
        return sorted(active, key=lambda a: rank.get(a.name, len(rank)))

    def timed_steps(self) -> list[int]:
        return [t for t in range(1, self.steps + 1) if self.role(t) == TIMED]


# ---------------------------------------------------------------------------- gradient scale
class NormInputGrads:
    """Squared gradient norm at each norm layer's input, summed on the device (no host sync per
    norm); hooks are placed only while ``active`` (profiled steps)."""

    def __init__(self, norms: list[tuple[str, torch.nn.Module]]):
        self.names = [n for n, _ in norms]
        self.active = False
        self.sq: torch.Tensor | None = None
        self._handles = [m.register_forward_pre_hook(self._pre(i)) for i, (_, m) in enumerate(norms)]

    def _pre(self, i):
        def hook(module, args):
            x = args[0] if args else None
            if self.active and torch.is_tensor(x) and x.requires_grad:
                if self.sq is None:
                    self.sq = torch.zeros(len(self.names), dtype=torch.float64, device=x.device)
                x.register_hook(lambda g, i=i: self._add(i, g))

        return hook

    def _add(self, i, g):
        self.sq[i] += g.detach().double().pow(2).sum()

    def reset(self) -> None:
        self.sq = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


# ---------------------------------------------------------------------------- memory
def param_bytes(model, optimizer) -> int:
    """Parameters and optimizer state (resident for the whole run)."""
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for st in optimizer.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    return n


CPU_MEMORY_METHOD = (
    "cpu: bytes of the tensor storages the step's ATen ops allocated and still held, "
    "summed after every op (dispatch mode; the CPU counterpart of max_memory_allocated)"
)
CUDA_MEMORY_METHOD = "cuda: max_memory_allocated after reset_peak_memory_stats, above memory_allocated before the step"


def memory_method(device) -> str | None:
    """How :class:`PeakMemory` measures on ``device``."""
    return CUDA_MEMORY_METHOD if torch.device(device).type == "cuda" else CPU_MEMORY_METHOD


def _storages(tree) -> list:
    return [t.untyped_storage() for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.layout == torch.strided]


class _StoragePeak:
    """Dispatch mode: the bytes of the storages created inside it that are still alive, after every
    op; the highest kept.

    A storage counts when an op returns it and none of the op's inputs held it (an in-place op or a
    view hands back what existed before). It stops counting when it is freed: each is held by a weak
    reference, and the expired ones are swept only when the running total (which still includes the
    freed) passes the peak, so a sweep happens only where a new peak is possible. Why not the C
    allocator's own count (glibc mallinfo2): it walks every free chunk of the heap, so in a long-lived,
    fragmented process one read costs milliseconds, and a step runs a thousand ops."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                outer._saw(out, (args, kwargs))
                return out

        self.mode = Mode()
        self.live: dict[int, tuple] = {}  # storage address -> (weak reference, bytes)
        self.total = 0  # bytes of self.live, the freed among them included until swept
        self.peak = 0

    def _saw(self, out, inputs) -> None:  # after every op of the step: imports at module level
        held = {st.data_ptr() for st in _storages(inputs)}
        for st in _storages(out):
            key = st.data_ptr()
            if key in held or st.nbytes() == 0:
                continue
            old = self.live.get(key)
            if old is not None and not old[0].expired():
                continue  # already counted (an op returning a tensor it made earlier)
            if old is not None:
                self.total -= old[1]  # the address of a freed storage, given to a new one
            self.live[key] = (StorageWeakRef(st), st.nbytes())
            self.total += st.nbytes()
        if self.total > self.peak:
            self._sweep()
            self.peak = max(self.peak, self.total)

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.total -= self.live.pop(key)[1]

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


class PeakMemory:
    """Context around one whole step (forward, backward, update): ``transient_bytes`` afterwards."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.method = memory_method(self.device)
        self.transient_bytes: int | None = None
        self._inner = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._inner = _StoragePeak().__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.transient_bytes = max(0, torch.cuda.max_memory_allocated(self.device) - self._base)
        else:
            self._inner.__exit__(*exc)
            self.transient_bytes = self._inner.peak
        return False


# ---------------------------------------------------------------------------- norm time
class NormTimer:
    """Seconds spent in the norms' forward and backward during one step (synchronising hooks)."""

    def __init__(self, norms: list[tuple[str, torch.nn.Module]], device):
        self.device = device
        self.seconds = 0.0
        self._t0: dict[int, float] = {}
        self._handles = []
        for i, (_, m) in enumerate(norms):
            self._handles.append(m.register_forward_pre_hook(self._fwd_pre(i)))
            self._handles.append(m.register_forward_hook(self._fwd_post(i)))

    def _now(self) -> float:
        synchronize(self.device)
        return time.perf_counter()

    def _fwd_pre(self, i):
        def hook(module, args):
            self._t0[i] = self._now()
            x = args[0] if args else None
            if torch.is_tensor(x) and x.requires_grad:
                x.register_hook(lambda g, i=i: self._bwd_end(i))

        return hook

    def _fwd_post(self, i):
        def hook(module, args, out):
            self.seconds += self._now() - self._t0.pop(i)
            y = out[0] if isinstance(out, tuple) else out
            if torch.is_tensor(y) and y.requires_grad:
                y.register_hook(lambda g, i=i: self._bwd_start(i))

        return hook

    def _bwd_start(self, i):
        self._t0[-1 - i] = self._now()

    def _bwd_end(self, i):
        t0 = self._t0.pop(-1 - i, None)
        if t0 is not None:
            self.seconds += self._now() - t0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


# ---------------------------------------------------------------------------- one arm's probe
def load_average() -> float | None:
    """The 1-minute load average now (normswap/host.py), None where the OS has none."""
    loads = host_load_average()
    return loads[0] if loads else None


class ArmProbe:
    """What one arm's steps measure, by role. The trainer wraps each whole step:

        with probe.step(t) as s:
            ...forward, backward, clip, update, zero_grad...
        probe.record(rec, t, s, optimizer)

    ``s.seconds`` is the step's wall time (synchronised on CUDA) — a throughput sample only when
    ``s.role`` is ``timed``."""

    def __init__(self, plan: StepPlan, model, norms, device):
        self.plan, self.model, self.norms, self.device = plan, model, norms, torch.device(device)
        self.grads = NormInputGrads(norms)

    @contextlib.contextmanager
    def step(self, t: int):
        from normswap.study.training.norm_impl import observe

        role = self.plan.role(t)
        s = _StepState(role)
        self.grads.reset()
        self.grads.active = role == PROFILE
        with contextlib.ExitStack() as stack:
            if role == FIRST:
                s.observed = stack.enter_context(observe(self.model))
            if role == MEMORY:
                s.memory = stack.enter_context(PeakMemory(self.device))
            if role == PROFILE:
                s.timer = NormTimer(self.norms, self.device)
                stack.callback(s.timer.remove)
            synchronize(self.device)
            t0 = time.perf_counter()
            yield s
            synchronize(self.device)
            s.seconds = time.perf_counter() - t0
        self.grads.active = False

    def record(self, rec: dict, t: int, s: _StepState, optimizer, *, reduce_sq=None) -> None:
        """Fill the unit record from step t; ``reduce_sq`` turns this process's squared norm-input
        gradient norms into the global, unscaled ones (across processes, loss scale)."""
        rec["step_seconds"].append(s.seconds)
        if s.role == TIMED:
            rec.setdefault("timed_steps", []).append(t)
        if s.observed is not None:
            rec.update(s.observed.summary())
        if s.memory is not None and s.memory.transient_bytes is not None:
            static = param_bytes(self.model, optimizer)
            rec["memory"] = {
                "step": t,
                "static_bytes": static,
                "transient_bytes": int(s.memory.transient_bytes),
                "peak_bytes": static + int(s.memory.transient_bytes),
                "method": s.memory.method,
            }
        if s.timer is not None:
            share = rec.get("norm_share") or {"steps": [], "norm_seconds": [], "step_seconds": []}
            share["steps"].append(t)
            share["norm_seconds"].append(s.timer.seconds)
            share["step_seconds"].append(s.seconds)
            total = sum(share["step_seconds"])
            share["share"] = sum(share["norm_seconds"]) / total if total > 0 else None
            rec["norm_share"] = share
            rec.setdefault("load", []).append(load_average())
        if s.role == PROFILE and self.grads.sq is not None:
            sq = self.grads.sq if reduce_sq is None else reduce_sq(self.grads.sq)
            g = rec["norm_input_grad_norm"]
            g.setdefault("steps", []).append(t)
            # one transfer, after the step
            g["per_step"].append([math.sqrt(v) if math.isfinite(v) else None for v in sq.tolist()])

    def remove(self) -> None:
        self.grads.remove()


class _StepState:
    def __init__(self, role: str):
        self.role = role
        self.seconds = 0.0
        self.observed = None
        self.memory = None
        self.timer = None
