"""`slice_model`: rotate and slice a converted model in memory (the Python API, and what
`normswap slice` runs before it writes anything).

Three bases (``basis=``):

- ``pca`` (the default and the shipped output): one rotation for the whole stream, the principal
  directions of Σ summed over every norm's input. Nothing is added at run time.
- ``random``: a seeded random rotation (u still deleted first): the control.
- ``per-layer``: a comparison arm after SliceGPT's design: one rotation per decoder layer (Σ of
  that layer's norms) and one for everything outside the layers (the embeddings, the final norm
  and the head: Σ of the norms outside the layers), with a k × k shortcut S = Q_prevᵀ·Q_this applied
  to the stream where it enters each layer and the outer norms (forward pre-hooks). SliceGPT
  itself rotates per *sublayer* (two shortcuts a layer, on each residual connection); this arm has
  one per layer, so it carries half the shortcut work of SliceGPT's own design. The shortcuts are
  hooks, not weights: a per-layer model runs in memory (the benchmark and the study) and is never
  written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from normswap.errors import NormswapError
from normswap.slice import basis as bases
from normswap.slice.calibrate import collect_moments
from normswap.slice.rotate import build_sliced, sliced_block, sliced_tensors
from normswap.slice.stream import StreamMap, stream_map

BASES = ("pca", "random", "per-layer")


@dataclass
class SliceResult:
    """What `slice_model` returns. ``kept_energy``: per norm, the share of its input's second-moment
    trace inside the kept columns (the basis that norm's position uses); ``basis_matrix``: the d × d
    basis (per position for ``per-layer``: {position: matrix})."""

    model: object
    width: int
    hidden_size: int
    fraction: float
    basis: str
    kept_energy: dict[str, float]
    kept_energy_total: float
    parameters_before: int
    parameters_after: int
    calibration_tokens: int
    basis_matrix: object = None
    moments: dict = field(default_factory=dict, repr=False)
    stream: StreamMap | None = field(default=None, repr=False)
    head_copy_parameters: int = 0  # the head's own rotated copy of a table that now holds other rows (BLOOM)

    def summary(self) -> dict:
        """The JSON-ready figures (what `normswap slice --json` and slice.json report)."""
        return {
            "width": self.width,
            "hidden_size": self.hidden_size,
            "fraction": self.fraction,
            "basis": self.basis,
            "parameters_before": self.parameters_before,
            "parameters_after": self.parameters_after,
            "calibration_tokens": self.calibration_tokens,
            "kept_energy_total": self.kept_energy_total,
            "dropped_energy_total": 1.0 - self.kept_energy_total,
            "kept_energy": dict(self.kept_energy),
            **(
                {
                    "head_copy_parameters": self.head_copy_parameters,
                    "fewer_parameters_than_original": self.parameters_after < self.parameters_before,
                }
                if self.head_copy_parameters
                else {}
            ),
        }


def parameter_count(model) -> int:
    """Parameters of ``model``, each tied group once."""
    return sum(p.numel() for p in model.parameters())  # each shared parameter once


def check_fraction(fraction: float, *, allow_zero: bool) -> float:
    fraction = float(fraction)
    low_ok = fraction >= 0 if allow_zero else fraction > 0
    if not (low_ok and fraction < 1) or math.isnan(fraction):
        bound = "[0, 1)" if allow_zero else "(0, 1)"
        raise NormswapError(
            f"--fraction must be in {bound} (the share of the stream's width to delete), got {fraction}"
        )
    return fraction


def slice_model(
    model, calibration_batches, fraction: float, *, basis: str = "pca", seed: int = 0, round_to: int = 8, progress=None
) -> SliceResult:
    """Rotate and slice ``model`` (a normswap exact conversion in memory; left unchanged) and return
    the sliced model with its figures.

    ``calibration_batches``: token-id tensors [batch, seq] (``calibration.calibration_batches``);
    ``fraction``: the share of the stream's width d to delete, in [0, 1): k = min(d − 1,
    round(d·(1 − F)/round_to)·round_to), so F = 0 deletes only the all-ones direction, which an
    exact conversion's stream never uses (the result reproduces the conversion). ``basis``: pca,
    random (seeded by ``seed``) or per-layer (module docstring)."""
    fraction = check_fraction(fraction, allow_zero=True)
    if basis not in BASES:
        raise NormswapError(f"--basis must be one of {', '.join(BASES)}, got {basis!r}")
    stream = stream_map(model)
    say = progress or (lambda msg: None)
    moments, tokens = collect_moments(model, list(calibration_batches), list(stream.norms), progress=progress)
    d = stream.hidden_size
    k = bases.width_for(d, fraction, round_to)
    say(f"slicing the residual stream from {d} to {k} ({basis} basis, {tokens:,} calibration tokens)")
    if basis == "per-layer":
        return _per_layer(model, stream, moments, tokens, k, fraction)
    if basis == "pca":
        q, _ = bases.pca_basis(sum(moments.values()))
    else:
        q = bases.random_basis(d, seed)
    sliced = rotate_model(model, stream, q, k, fraction=fraction, basis=basis)
    kept = {name: bases.kept_energy(s, q[:, :k]) for name, s in moments.items()}
    return SliceResult(
        model=sliced,
        width=k,
        hidden_size=d,
        fraction=fraction,
        basis=basis,
        kept_energy=kept,
        kept_energy_total=bases.kept_energy(sum(moments.values()), q[:, :k]),
        parameters_before=parameter_count(model),
        parameters_after=parameter_count(sliced),
        calibration_tokens=tokens,
        basis_matrix=q,
        moments=moments,
        stream=stream,
        head_copy_parameters=_head_copy_parameters(sliced, stream),
    )


def _head_copy_parameters(sliced, stream: StreamMap) -> int:
    """Parameters of the head's own table copy (``StreamMap.head_copy``), counted in parameters_after."""
    if not stream.head_copy:
        return 0
    return int(dict(sliced.named_parameters())[stream.head_copy].numel())


def rotate_model(model, stream: StreamMap, q: torch.Tensor, k: int, *, fraction: float, basis: str, q_for=None):
    """The sliced model for one basis ``q`` (d × d, u last) kept to ``k`` columns; ``q_for(key)``
    overrides the basis per parameter (the per-layer arm)."""
    block = sliced_block(model.config.normswap, stream, k, fraction=fraction, basis=basis)
    tensors = sliced_tensors(model, stream, k, q_for or (lambda key: q))
    return build_sliced(model, block, tensors)


# -- the per-layer comparison arm ---------------------------------------------------------------


def _layer_list(model) -> tuple[str, int]:
    """(full name of the decoder-layer list, its length), from the family data of the conversion."""
    from torch import nn

    from normswap.architectures.registry import get_family
    from normswap.architectures.schema import parse_family

    block = model.config.normswap
    described = block.get("discovered_family")
    family = parse_family(described, "config.json") if described else get_family(block["family"])
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = prefix + "." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    path = base + family.layers
    try:
        return path, len(model.get_submodule(path))
    except AttributeError:
        raise NormswapError(f"{family.name}: layer list {path!r} not found; the per-layer basis needs it") from None


def _position(name: str, layers: str, count: int):
    """The layer index a module or parameter name sits in, or "outer" (embeddings, final norm, head)."""
    if name.startswith(layers + "."):
        head = name[len(layers) + 1 :].split(".", 1)[0]
        if head.isdigit() and int(head) < count:
            return int(head)
    return "outer"


def _shortcut_hook(matrix: torch.Tensor):
    def hook(module, args, kwargs):
        if args and isinstance(args[0], torch.Tensor):
            x = args[0]
            return (x @ matrix.to(dtype=x.dtype, device=x.device),) + tuple(args[1:]), kwargs
        x = kwargs.get("hidden_states")
        if isinstance(x, torch.Tensor):
            return args, {**kwargs, "hidden_states": x @ matrix.to(dtype=x.dtype, device=x.device)}
        return None

    return hook


def _per_layer(model, stream: StreamMap, moments: dict, tokens: int, k: int, fraction: float) -> SliceResult:
    layers, count = _layer_list(model)
    d = stream.hidden_size
    by_position: dict = {}
    for name, s in moments.items():
        pos = _position(name, layers, count)
        by_position[pos] = by_position.get(pos, 0) + s
    if "outer" not in by_position:  # no norm outside the layers: the embeddings start in the first layer's basis
        by_position["outer"] = by_position.get(0, sum(moments.values()))
    total = sum(moments.values())
    qs = {pos: bases.pca_basis(by_position.get(pos, total))[0] for pos in ["outer", *range(count)]}
    sliced = rotate_model(
        model,
        stream,
        qs["outer"],
        k,
        fraction=fraction,
        basis="per-layer",
        q_for=lambda key: qs[_position(key, layers, count)],
    )
    shortcuts = 0
    previous = "outer"
    for i in range(count):
        s = qs[previous][:, :k].T @ qs[i][:, :k]
        sliced.get_submodule(layers + f".{i}").register_forward_pre_hook(_shortcut_hook(s), with_kwargs=True)
        shortcuts += s.numel()
        previous = i
    s = qs[previous][:, :k].T @ qs["outer"][:, :k]
    for name in stream.norms:
        if _position(name, layers, count) == "outer":
            sliced.get_submodule(name).register_forward_pre_hook(_shortcut_hook(s), with_kwargs=True)
            shortcuts += s.numel()
    kept = {name: bases.kept_energy(sig, qs[_position(name, layers, count)][:, :k]) for name, sig in moments.items()}
    kept_total = sum(kept[n] * float(torch.trace(moments[n])) for n in moments) / float(torch.trace(total))
    return SliceResult(
        model=sliced,
        width=k,
        hidden_size=d,
        fraction=fraction,
        basis="per-layer",
        kept_energy=kept,
        kept_energy_total=kept_total,
        parameters_before=parameter_count(model),
        parameters_after=parameter_count(sliced) + shortcuts,
        calibration_tokens=tokens,
        basis_matrix=qs,
        moments=moments,
        stream=stream,
    )
