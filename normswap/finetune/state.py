"""Resumable training state: one checkpoint directory, in formats that load without running code.

A checkpoint ``OUT/checkpoints/step-K`` holds

    model.safetensors        the full weights (tied weights stored once; the aliases in its metadata)
    optimizer.pt             the optimizer state (tensors, numbers, strings), read with
                             ``torch.load(weights_only=True)``, which refuses any other object
    rng-R.safetensors/.json  process R's random generators (torch, CUDA, numpy, Python)
    trainer_state.json       step, data position, epoch, number of processes

Nothing in it is unpickled as an arbitrary object, so a checkpoint that someone replaced cannot
run code; a file that fails to load is named in the error. Every file is read and written through a
handle on the checkpoint's directory (``dir_fd``, run_dir.RunDir.checkpoint_at) and opened without
following a link, never by a path: a file linked out of the run directory, or one another user can
write, is refused by name. The optimizer state is checked against the one this run's
optimizer has (same parameters, groups, shapes, finite numbers) before it is applied, so a tampered
``optimizer.pt`` is named instead of failing later in a way that blames the learning rate.

The learning rate is not state: it is a function of the step (``schedule.lr_factor``), so a resume
may lower ``--lr``.

The weights are also checked for sanity against the model the run started from: every value
finite and no tensor's RMS beyond ``EXPLODED`` times its start (or the model-wide start RMS for
tensors that start near zero). A checkpoint that fails is never written, and never resumed from.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from normswap import private_dirs as pd
from normswap.errors import NormswapError, first_line

TRAINER_STATE = "trainer_state.json"
WEIGHTS = "model.safetensors"
OPTIMIZER = "optimizer.pt"
MAX_JSON_BYTES = 16 << 20  # trainer_state.json and the RNG metadata: a few kB
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


# ---------------------------------------------------------------------------------- optimizer sanity
def optimizer_template(model, optimizer) -> dict:
    """This run's optimizer state in the stored form (parameter names, groups, state shapes): what a
    checkpoint's ``optimizer.pt`` must match (a collective under FSDP: every process calls it)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_state_options(cpu_offload=True))


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _value_problem(name: str, value, like) -> str | None:
    """Why ``value`` cannot stand where this run's optimizer has ``like`` (same kind, finite), or None."""
    if isinstance(like, torch.Tensor):
        if not isinstance(value, torch.Tensor):
            return f"{name} is {type(value).__name__}, not a tensor"
        if tuple(value.shape) != tuple(like.shape) and like.numel() != 1:
            return f"{name} has shape {list(value.shape)}, the model's parameter {list(like.shape)}"
        if value.numel() != like.numel() or not value.is_floating_point() or not bool(value.isfinite().all()):
            return f"{name} is not {like.numel()} finite number(s)"
        return None
    if isinstance(like, bool) or like is None:
        return None if value is None or isinstance(value, bool) else f"{name} is {value!r}, not true/false"
    if _is_number(like):
        return None if _is_number(value) and math.isfinite(value) else f"{name} is {value!r}, not a finite number"
    if isinstance(like, (tuple, list)):
        if not isinstance(value, (tuple, list)) or len(value) != len(like):
            return f"{name} is {value!r}, not {len(like)} values"
        return next((p for v, x in zip(value, like) if (p := _value_problem(name, v, x))), None)
    return None if type(value) is type(like) else f"{name} is {type(value).__name__}, not {type(like).__name__}"


def optimizer_problem(stored, like: dict) -> str | None:
    """Why ``stored`` (a loaded optimizer.pt) is not an AdamW state of this run's parameters, or None:
    the same groups over the same parameters with the same settings' kinds, the same per-parameter
    state (moments of each parameter's shape, a step count), every number finite."""
    if not isinstance(stored, dict) or not isinstance(stored.get("state"), dict):
        return "is not an optimizer state"
    groups, want = stored.get("param_groups"), like["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(want):
        return f"has {len(groups) if isinstance(groups, list) else 'no'} parameter groups, this run {len(want)}"
    for k, (group, w) in enumerate(zip(groups, want)):
        if not isinstance(group, dict) or set(group) != set(w):
            return f"parameter group {k} does not have the settings of this run's optimizer"
        if group["params"] != w["params"]:
            return f"parameter group {k} holds other parameters than this run trains"
        problem = next((p for key in w if key != "params" and (p := _value_problem(key, group[key], w[key]))), None)
        if problem:
            return f"parameter group {k}: {problem}"
    if set(stored["state"]) - set(like["state"]):
        return f"has state for {sorted(set(stored['state']) - set(like['state']))[0]}, which this run does not train"
    for param, entry in stored["state"].items():
        expected = like["state"][param]
        if not isinstance(entry, dict) or set(entry) != set(expected):
            return f"the state of {param} is not AdamW's ({', '.join(sorted(expected))})"
        for key, like_value in expected.items():
            problem = _value_problem(f"{param} {key}", entry[key], like_value)
            if problem:
                return problem
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


def _put(dir_fd: int, name: str, data: bytes, where: Path) -> None:
    fd = pd.create_file_at(dir_fd, name, where=where / name)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _put_safetensors(dir_fd: int, name: str, tensors: dict, where: Path, metadata=None) -> None:
    """A safetensors file written into the directory handle: through /proc/self/fd (the weights are
    streamed by safetensors, not held twice in memory) into a file created fresh with O_EXCL, else
    as bytes."""
    from safetensors.torch import save, save_file

    if not pd.has_fd_paths():
        _put(dir_fd, name, save(tensors, metadata=metadata), where)
        return
    os.close(pd.create_file_at(dir_fd, name, where=where / name))
    save_file(tensors, pd.fd_path(dir_fd, name), metadata=metadata)


def save(
    dir_fd: int,
    where: Path,
    *,
    model,
    optimizer,
    weights: dict[str, torch.Tensor],
    trainer_state: dict,
    rank: int,
    main: bool,
) -> None:
    """Write this process' share of a checkpoint into the fresh directory ``dir_fd`` (shown as
    ``where``; every process calls it; ``weights`` comes from ``full_weights``)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optimizer_state = get_optimizer_state_dict(model, optimizer, options=_state_options(cpu_offload=True))
    tensors, meta = _capture_rng()
    rng_tensors, rng_json = _rng_files(rank)
    _put_safetensors(dir_fd, rng_tensors, {k: v.contiguous() for k, v in tensors.items()}, where)
    _put(dir_fd, rng_json, json.dumps(meta).encode(), where)
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
    _put_safetensors(dir_fd, WEIGHTS, stored, where, metadata={"aliases": json.dumps(aliases)})
    with os.fdopen(pd.create_file_at(dir_fd, OPTIMIZER, where=where / OPTIMIZER), "wb") as f:
        torch.save(optimizer_state, f)
    _put(dir_fd, TRAINER_STATE, json.dumps(trainer_state).encode(), where)


@dataclass
class Loaded:
    """A checkpoint read into memory and checked, not yet applied to the model."""

    path: Path
    trainer_state: dict
    weights: dict[str, torch.Tensor]
    optimizer_state: dict
    rng: tuple[dict[str, torch.Tensor], dict]


def _read_safetensors(fd: int) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, metadata) of the open safetensors file ``fd``: reopened through /proc/self/fd (the
    same file, not its name again), else read as bytes."""
    from safetensors import safe_open
    from safetensors.torch import load, load_file

    if pd.has_fd_paths():
        path = pd.fd_path(fd)
        with safe_open(path, "pt") as f:
            metadata = f.metadata() or {}
        return load_file(path), metadata
    with os.fdopen(os.dup(fd), "rb") as f:
        data = f.read()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    return load(data), header.get("__metadata__") or {}


def _json(fd: int):
    with os.fdopen(os.dup(fd), "rb") as f:
        return json.loads(f.read(MAX_JSON_BYTES))


def _torch(fd: int):
    with os.fdopen(os.dup(fd), "rb") as f:
        return torch.load(f, map_location="cpu", weights_only=True)


def read(dir_fd: int, directory: Path, *, rank: int, world: int, start: WeightScale, optimizer_like: dict) -> Loaded:
    """Read and check every file of the checkpoint open at ``dir_fd`` (shown as ``directory``);
    ``CheckpointError`` names the first that fails. ``optimizer_like``: this run's optimizer
    state (optimizer_template), what the stored one must match. A checkpoint of another number of
    processes is refused (NormswapError): it is not broken."""

    def fail(name, why):
        raise CheckpointError(f"{directory / name}: {why}")

    def load(name, reader):
        try:
            fd = pd.open_file_at(dir_fd, name, where=directory / name)
        except FileNotFoundError:
            fail(name, "missing (an incomplete checkpoint, or one written by an older normswap)")
        except pd.NotPrivate as e:
            raise CheckpointError(str(e)) from None
        try:
            return reader(fd)
        except Exception as e:  # any failure to parse is a broken file, whatever the library raises
            fail(name, f"cannot be read ({first_line(e)})")
        finally:
            os.close(fd)

    state = load(TRAINER_STATE, _json)
    if not isinstance(state, dict) or not all(
        isinstance(state.get(k), int) and not isinstance(state.get(k), bool) and state[k] >= 0
        for k in ("step", "data_position", "world_size")
    ):
        fail(TRAINER_STATE, "lacks step, data_position or world_size (whole numbers, not negative)")
    if state["world_size"] != world:
        raise NormswapError(
            f"cannot resume: {directory} was written by {state['world_size']} processes, this launch has {world}; "
            "relaunch with the same number"
        )
    weights, metadata = load(WEIGHTS, _read_safetensors)
    try:
        aliases = json.loads(metadata.get("aliases", "{}"))
        for alias, name in aliases.items():
            weights[alias] = weights[name]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        fail(WEIGHTS, f"its tied-weight names cannot be read ({first_line(e)})")
    problem = start.problem(weights)
    if problem:
        fail(WEIGHTS, problem)
    optimizer_state = load(OPTIMIZER, _torch)
    # a process that holds no full template (FSDP gathers it on process 0 only) leaves the check to
    # process 0: restore agrees on every verdict across processes
    problem = optimizer_problem(optimizer_state, optimizer_like) if optimizer_like.get("param_groups") else None
    if problem:
        fail(OPTIMIZER, problem)
    rng_tensors, rng_json = _rng_files(rank)
    rng = (load(rng_tensors, lambda fd: _read_safetensors(fd)[0]), load(rng_json, _json))
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
