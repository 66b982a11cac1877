"""Peak memory of one training step (forward + backward + AdamW step), per model.

What is counted: the bytes of the tensors one model needs to train - weights, gradients, AdamW
state, activations and temporaries of a batch_size x seq_len step - not what other models held
in the same run, and not allocator caching or the Python/CUDA runtime.
- CUDA: ``torch.cuda.max_memory_allocated`` during the step, minus what was allocated before
  it (other models' weights included), plus this model's own resident tensors (parameters,
  buffers, optimizer state).
- CPU: PyTorch keeps no CPU allocation counter and one process' RSS mixes every model it holds
  (and grows by hundreds of MB of lazily loaded kernels on the first backward), so the step runs
  under PyTorch's ``MemTracker`` (torch.distributed._tools), which follows every tensor's storage
  and reports the same quantity as the CUDA number, with a breakdown (parameters, gradients,
  activations, temporaries, optimizer state). It is a private PyTorch tool: if it is missing or
  fails, the result is ``None`` with the reason, never a guess.
"""

from __future__ import annotations

import torch

from normswap.evaluate.kinds import training_loss
from normswap.evaluate.perplexity import model_device


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def resident_bytes(model, optimizer=None) -> int:
    total = _tensor_bytes(model.parameters()) + _tensor_bytes(model.buffers())
    if optimizer is not None:
        for state in optimizer.state.values():
            total += _tensor_bytes(v for v in state.values() if torch.is_tensor(v))
    return total


def train_step_inputs(model, batch_size: int, seq_len: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, int(model.config.vocab_size), (batch_size, seq_len), generator=g).to(model_device(model))


def _step(model, optimizer, batch):
    model.train()
    try:
        training_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    finally:
        model.eval()


def _optimizer(model):
    # lr=0: every optimizer operation runs, the weights stay as loaded.
    return torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)


def cuda_peak(model, batch_size: int, seq_len: int) -> dict:
    device = model_device(model)
    batch = train_step_inputs(model, batch_size, seq_len)
    optimizer = _optimizer(model)
    _step(model, optimizer, batch)  # creates the optimizer state; not measured
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    _step(model, optimizer, batch)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    own = resident_bytes(model, optimizer)
    del optimizer
    torch.cuda.empty_cache()
    return {
        "peak_memory_bytes": int(peak - before + own),
        "method": "cuda max_memory_allocated over one train step, this model's tensors only",
        "resident_bytes": own,
    }


def tracked_peak(model, batch_size: int, seq_len: int) -> dict:
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except Exception as e:  # not built with distributed, or moved in a later PyTorch
        return {
            "peak_memory_bytes": None,
            "method": "not measured",
            "reason": f"torch MemTracker unavailable ({type(e).__name__})",
        }
    batch = train_step_inputs(model, batch_size, seq_len)
    optimizer = _optimizer(model)
    _step(model, optimizer, batch)  # optimizer state exists before measuring, as in training
    try:
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            _step(model, optimizer, batch)
        snapshot = tracker.get_tracker_snapshot("peak")
    except Exception as e:
        return {
            "peak_memory_bytes": None,
            "method": "not measured",
            "reason": f"MemTracker failed: {type(e).__name__}: {e}"[:200],
        }
    finally:
        model.zero_grad(set_to_none=True)
    per_device = snapshot.get(model_device(model)) or next(iter(snapshot.values()), {})
    breakdown = {}
    total = None
    for key, value in per_device.items():
        if key == "Total":
            total = int(value)
        else:
            breakdown[getattr(key, "value", str(key)).lower()] = int(value)
    own = resident_bytes(model, optimizer)
    del optimizer
    return {
        "peak_memory_bytes": total,
        "method": "tensor bytes at the peak of one train step (torch MemTracker)",
        "breakdown": breakdown,
        "resident_bytes": own,
    }


def peak_memory(model, batch_size: int, seq_len: int) -> dict:
    if model_device(model).type == "cuda":
        return cuda_peak(model, batch_size, seq_len)
    return tracked_peak(model, batch_size, seq_len)
