"""Resumable training state: one checkpoint directory, in formats that load without running code.

A checkpoint ``OUT/checkpoints/step-K`` holds

    model.safetensors        the full weights (tied weights stored once; the aliases in its metadata)
    optimizer.pt             the optimizer state (tensors, numbers, strings), read with
                             ``torch.load(weights_only=True)``, which refuses any other object
    rng-R.safetensors/.json  process R's random generators (torch, CUDA, numpy, Python)
    trainer_state.json       step, data position, epoch, number of processes

Nothing in it is unpickled as an arbitrary object, so a checkpoint that someone replaced cannot
run code; a file that fails to load is named in the error. The learning rate is not state: it is
a function of the step (``schedule.lr_factor``), so a resume may lower ``--lr``.

The weights are also checked for sanity against the model the run started from: every value
finite and no tensor's RMS beyond ``EXPLODED`` times its start (or the model-wide start RMS for
tensors that start near zero). A checkpoint that fails is never written, and never resumed from.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from normswap.errors import NormswapError, first_line

TRAINER_STATE = "trainer_state.json"
WEIGHTS = "model.safetensors"
OPTIMIZER = "optimizer.pt"
EXPLODED = 10.0  # RMS growth that no healing fine-tune comes near (measured changes are a few %)


class CheckpointError(NormswapError):
    """A checkpoint that cannot be used; the message names the file and why."""


def _rng_files(rank: int) -> tuple[str, str]:
    return f"rng-{rank}.safetensors", f"rng-{rank}.json"


# ---------------------------------------------------------------------------------- weight sanity
@dataclass
class WeightScale:
    """Per-tensor shape and RMS of the weights a run started from: what a checkpoint must match."""

    shapes: dict[str, tuple[int, ...]]
    rms: dict[str, float]
    overall_rms: float

    @classmethod
    def of(cls, state: dict[str, torch.Tensor]) -> WeightScale:
        shapes, rms, total, count = {}, {}, 0.0, 0
        for name, t in state.items():
            shapes[name] = tuple(t.shape)
            if not t.is_floating_point() or t.numel() == 0:
                continue
            sq = float(t.detach().double().pow(2).sum())
            rms[name] = math.sqrt(sq / t.numel())
            total, count = total + sq, count + t.numel()
        return cls(shapes, rms, math.sqrt(total / max(count, 1)))

    def problem(self, state: dict[str, torch.Tensor]) -> str | None:
        """Why ``state`` is not a sane descendant of these weights, or None."""
        now = WeightScale.of(state)
        if now.shapes != self.shapes:
            missing = sorted(set(self.shapes) - set(now.shapes))
            extra = sorted(set(now.shapes) - set(self.shapes))
            wrong = sorted(k for k in set(now.shapes) & set(self.shapes) if now.shapes[k] != self.shapes[k])
            what = (
                f"lacks {missing[0]}"
                if missing
                else f"has an unknown weight {extra[0]}"
                if extra
                else f"{wrong[0]} has shape {list(now.shapes[wrong[0]])}, the model {list(self.shapes[wrong[0]])}"
            )
            return f"does not fit the model ({what})"
        for name, r in now.rms.items():
            if not math.isfinite(r):
                return f"{name} holds non-finite values"
            limit = EXPLODED * max(self.rms.get(name, 0.0), self.overall_rms)
            if r > limit:
                return (
                    f"weights exploded ({name}: RMS {r:.3g}, "
                    f"{r / max(self.rms.get(name, 0.0), self.overall_rms):.3g}× its start)"
                )
        return None


# ---------------------------------------------------------------------------------- random state
def _capture_rng() -> tuple[dict[str, torch.Tensor], dict]:
    import numpy as np

    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    meta = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
    }
    return tensors, meta


def _restore_rng(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    import numpy as np

    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# ---------------------------------------------------------------------------------- save / load
def _state_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_weights(model) -> dict[str, torch.Tensor]:
    """The full, unsharded weights on the CPU (a collective under FSDP: every process calls it)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_state_options(cpu_offload=True))


def save(
    directory: Path, *, model, optimizer, weights: dict[str, torch.Tensor], trainer_state: dict, rank: int, main: bool
) -> None:
    """Write this process' share of a checkpoint into ``directory`` (every process calls it;
    ``weights`` comes from ``full_weights``)."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optimizer_state = get_optimizer_state_dict(model, optimizer, options=_state_options(cpu_offload=True))
    tensors, meta = _capture_rng()
    rng_tensors, rng_json = _rng_files(rank)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / rng_tensors))
    (directory / rng_json).write_text(json.dumps(meta))
    if not main:
        return
    stored, aliases, seen = {}, {}, {}
    for name, t in weights.items():  # tied weights (one storage, several names) are stored once
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            stored[name] = t.contiguous()
    save_file(stored, str(directory / WEIGHTS), metadata={"aliases": json.dumps(aliases)})
    torch.save(optimizer_state, directory / OPTIMIZER)
    (directory / TRAINER_STATE).write_text(json.dumps(trainer_state))


@dataclass
class Loaded:
    """A checkpoint read into memory and checked, not yet applied to the model."""

    path: Path
    trainer_state: dict
    weights: dict[str, torch.Tensor]
    optimizer_state: dict
    rng: tuple[dict[str, torch.Tensor], dict]


def read(directory: Path, *, rank: int, world: int, start: WeightScale) -> Loaded:
    """Read and check every file of a checkpoint; ``CheckpointError`` names the first that fails.
    A checkpoint of another number of processes is refused (NormswapError): it is not broken."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    def fail(name, why):
        raise CheckpointError(f"{directory / name}: {why}")

    def load(name, reader):
        if not (directory / name).is_file():
            fail(name, "missing (an incomplete checkpoint, or one written by an older normswap)")
        try:
            return reader(directory / name)
        except Exception as e:  # any failure to parse is a broken file, whatever the library raises
            fail(name, f"cannot be read ({first_line(e)})")

    state = load(TRAINER_STATE, lambda p: json.loads(p.read_text()))
    if not isinstance(state, dict) or not all(
        isinstance(state.get(k), int) for k in ("step", "data_position", "world_size")
    ):
        fail(TRAINER_STATE, "lacks step, data_position or world_size")
    if state["world_size"] != world:
        raise NormswapError(
            f"cannot resume: {directory} was written by {state['world_size']} processes, this launch has {world}; "
            "relaunch with the same number"
        )
    weights = load(WEIGHTS, lambda p: load_file(str(p)))
    with safe_open(str(directory / WEIGHTS), "pt") as f:
        aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
    for alias, name in aliases.items():
        weights[alias] = weights[name]
    problem = start.problem(weights)
    if problem:
        fail(WEIGHTS, problem)
    optimizer_state = load(OPTIMIZER, lambda p: torch.load(p, map_location="cpu", weights_only=True))
    if not isinstance(optimizer_state, dict) or "state" not in optimizer_state or "param_groups" not in optimizer_state:
        fail(OPTIMIZER, "is not an optimizer state")
    rng_tensors, rng_json = _rng_files(rank)
    rng = (load(rng_tensors, lambda p: load_file(str(p))), load(rng_json, lambda p: json.loads(p.read_text())))
    return Loaded(directory, state, weights, optimizer_state, rng)


def apply(loaded: Loaded, *, model, optimizer) -> None:
    """Put a checkpoint read by ``read`` into the (prepared) model, optimizer and random generators."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    try:
        set_model_state_dict(model, loaded.weights, options=_state_options())
    except Exception as e:
        raise CheckpointError(f"{loaded.path / WEIGHTS}: does not fit the model ({first_line(e)})") from None
    try:
        set_optimizer_state_dict(model, optimizer, loaded.optimizer_state, options=_state_options())
    except Exception as e:
        raise CheckpointError(f"{loaded.path / OPTIMIZER}: does not fit the optimizer ({first_line(e)})") from None
    try:
        _restore_rng(*loaded.rng)
    except Exception as e:
        raise CheckpointError(f"{loaded.path}: random state cannot be restored ({first_line(e)})") from None
