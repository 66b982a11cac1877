"""What a training step measures besides its loss and global gradient norm.

* ``NormInputGrads``: the gradient norm arriving at each norm layer's input (a tensor hook on the
  input, registered by a forward pre-hook), per step.
* ``step_memory``: an arm's peak memory in one step, as bytes it owns. On CUDA: its parameters and
  optimizer state (resident) plus the rise of ``torch.cuda.max_memory_allocated`` over the step
  (activations, gradients, temporaries). On CPU torch has no allocator statistics, so the transient
  part is counted instead: the bytes of every distinct tensor saved for the backward pass (a
  ``saved_tensors_hooks`` pack hook, parameters excluded) plus the gradients' bytes — what the
  LayerNorm/RMSNorm difference changes (LayerNorm keeps a mean beside the inverse RMS). Counted,
  not sampled: the same on every run.
* ``NormTimer``: the norms' share of step time on a profiled step: wall time inside each norm's
  forward (pre/post hooks) plus its backward (from the gradient reaching the norm's output to the
  one leaving its input), divided by the step's wall time. CUDA is synchronised at each edge.
"""

from __future__ import annotations

import time

import torch


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class NormInputGrads:
    """Squared gradient norm at each norm layer's input, accumulated over one step."""

    def __init__(self, norms: list[tuple[str, torch.nn.Module]]):
        self.names = [n for n, _ in norms]
        self.sq = [0.0] * len(norms)
        self._handles = [m.register_forward_pre_hook(self._pre(i)) for i, (_, m) in enumerate(norms)]

    def _pre(self, i):
        def hook(module, args):
            x = args[0] if args else None
            if torch.is_tensor(x) and x.requires_grad:
                x.register_hook(lambda g, i=i: self._add(i, g))

        return hook

    def _add(self, i, g):
        self.sq[i] += float(g.detach().float().pow(2).sum())

    def reset(self) -> None:
        self.sq = [0.0] * len(self.sq)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def param_bytes(model, optimizer) -> int:
    """Parameters and optimizer state (resident for the whole run)."""
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for st in optimizer.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    return n


class SavedBytes:
    """Context: the bytes of distinct storages saved for backward (parameters excluded)."""

    def __init__(self, model):
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.bytes = 0

    def _pack(self, t):
        try:
            s = t.untyped_storage()
            key = s.data_ptr()
            if key not in self.skip and key not in self.seen:
                self.seen.add(key)
                self.bytes += s.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def grad_bytes(model) -> int:
    return sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)


class NormTimer:
    """Seconds spent in the norms' forward and backward during one step."""

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
