"""The schema of a family data file, and its validation.

A family file (``data/<name>.yaml``) says, for one transformers architecture family, which
modules are LayerNorms, which linears read each norm, which modules write the residual stream,
and how the head is tied. Module paths are relative to the *base model* (the submodule named by
``model.base_model_prefix``, e.g. ``transformer`` in GPT2LMHeadModel), so one file serves the
bare model and every head class; paths under ``head`` and ``head_norms`` are relative to the top
model. ``${i}`` stands for the layer index. An entry with ``when: {config_attr: value}`` applies
only when the config matches; ``optional: true`` lets a module be absent (layouts that vary by
config). Everything is checked when the file is loaded, and errors name the file and the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from normswap.errors import NormswapError

PLACEMENTS = ("pre", "post")
_TEMPLATE_VAR = re.compile(r"\$\{(\w+)\}")


@dataclass(frozen=True)
class NormEntry:
    norm: str
    readers: tuple[str, ...] = ()
    when: dict = field(default_factory=dict)
    optional: bool = False
    # The norm's output starts the residual stream (BLOOM's embedding LayerNorm): in exact mode
    # its output must be re-centred at run time because γ⊙n + β is not zero-mean.
    starts_stream: bool = False
    # γ = weight + gamma_offset (1 for Nemotron's LayerNorm1P); ε when the module has no eps attribute
    gamma_offset: float = 0.0
    eps: float | None = None


@dataclass(frozen=True)
class ModuleEntry:
    module: str
    when: dict = field(default_factory=dict)
    optional: bool = False


@dataclass(frozen=True)
class StreamScale:
    scale: str  # a parameter path (a vector over the hidden size)
    writer: str  # the Linear whose output it scales


@dataclass(frozen=True)
class LeaveAlone:
    pattern: str  # a regular expression over full module names
    reason: str


@dataclass(frozen=True)
class Family:
    name: str
    display: str
    model_types: tuple[str, ...]
    placement: str | dict  # "pre" | "post" | {"attribute": a, "values": {val: placement}}
    layers: str
    embeddings: tuple[ModuleEntry, ...]
    writers: tuple[ModuleEntry, ...]
    norms: tuple[NormEntry, ...]
    final_norm: NormEntry | None
    head: str | None
    head_norms: tuple[NormEntry, ...]
    leave_alone: tuple[LeaveAlone, ...]
    notes: str
    examples: tuple[str, ...]
    test_configs: tuple[dict, ...]
    source: str  # the file it came from
    # modules whose first input is centred at run time (a stream start no single module writes,
    # e.g. Whisper's conv features + positions computed inline in the encoder's forward)
    centered_inputs: tuple[str, ...] = ()
    # parameters added to the residual stream as they are (a bias vector a module returns beside its
    # output, GPT-NeoX-Japanese's dense_bias): exact mode centres the vector itself
    stream_biases: tuple[str, ...] = ()
    # layer scales applied to a writer's output before the addition (InternVL's lambda_1 ⊙ o_proj(x)):
    # exact mode folds λ into the writer's rows (then centred) and sets λ to ones
    stream_scales: tuple[StreamScale, ...] = ()
    discovered: bool = False  # written by `normswap families discover`, not curated
    description: dict | None = field(default=None, compare=False)  # the parsed dict of a discovered family

    def placement_for(self, config) -> str:
        if isinstance(self.placement, str):
            return self.placement
        value = getattr(config, self.placement["attribute"], None)
        values = self.placement["values"]
        key = str(value).lower() if isinstance(value, bool) else str(value)
        if key not in values:
            raise NormswapError(
                f"{self.name}: config.{self.placement['attribute']}={value!r} "
                f"is not a layout the family data knows ({self.source})"
            )
        return values[key]


_TOP_KEYS = {
    "name": str,
    "display": str,
    "model_types": list,
    "placement": (str, dict),
    "layers": str,
    "embeddings": list,
    "writers": list,
    "norms": list,
    "final_norm": (dict, type(None)),
    "head": (str, type(None)),
    "head_norms": list,
    "leave_alone": list,
    "notes": str,
    "examples": list,
    "test_configs": list,
    "centered_inputs": list,
    "stream_biases": list,
    "stream_scales": list,
    "discovered": bool,
}
_REQUIRED = ("name", "model_types", "placement", "layers", "norms")
_NORM_KEYS = {"norm", "readers", "when", "optional", "starts_stream", "gamma_offset", "eps"}
_MODULE_KEYS = {"module", "when", "optional"}


def _fail(source, where, msg):
    raise NormswapError(f"invalid family file {source}: {where}: {msg}")


def _check_path(source, where, path):
    if not isinstance(path, str) or not path or path != path.strip() or " " in path:
        _fail(source, where, f"module path must be a non-empty dotted name, got {path!r}")
    for var in _TEMPLATE_VAR.findall(path):
        if var != "i":
            _fail(source, where, f"unknown template variable ${{{var}}} in {path!r} (only ${{i}}, the layer index)")


def _when(source, where, value):
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        _fail(source, where + ".when", "must map config attribute names to values")
    return dict(value)


def _norm_entry(source, where, raw) -> NormEntry:
    if not isinstance(raw, dict):
        _fail(source, where, "must be a mapping with 'norm' and 'readers'")
    unknown = set(raw) - _NORM_KEYS
    if unknown:
        _fail(source, where, f"unknown key(s) {sorted(unknown)}; allowed: {sorted(_NORM_KEYS)}")
    if "norm" not in raw:
        _fail(source, where, "missing key 'norm'")
    _check_path(source, where + ".norm", raw["norm"])
    readers = raw.get("readers", [])
    if not isinstance(readers, list):
        _fail(source, where + ".readers", "must be a list of module paths")
    for j, r in enumerate(readers):
        _check_path(source, f"{where}.readers[{j}]", r)
    for key in ("gamma_offset", "eps"):
        if key in raw and (isinstance(raw[key], bool) or not isinstance(raw[key], (int, float))):
            _fail(source, f"{where}.{key}", f"must be a number, got {raw[key]!r}")
    if "eps" in raw and not raw["eps"] > 0:
        _fail(source, f"{where}.eps", f"must be positive, got {raw['eps']!r}")
    return NormEntry(
        norm=raw["norm"],
        readers=tuple(readers),
        when=_when(source, where, raw.get("when")),
        optional=bool(raw.get("optional", False)),
        starts_stream=bool(raw.get("starts_stream", False)),
        gamma_offset=float(raw.get("gamma_offset", 0.0)),
        eps=float(raw["eps"]) if "eps" in raw else None,
    )


def _module_entry(source, where, raw) -> ModuleEntry:
    if isinstance(raw, str):
        raw = {"module": raw}
    if not isinstance(raw, dict) or "module" not in raw:
        _fail(source, where, "must be a module path or a mapping with 'module'")
    unknown = set(raw) - _MODULE_KEYS
    if unknown:
        _fail(source, where, f"unknown key(s) {sorted(unknown)}; allowed: {sorted(_MODULE_KEYS)}")
    _check_path(source, where + ".module", raw["module"])
    return ModuleEntry(raw["module"], _when(source, where, raw.get("when")), bool(raw.get("optional", False)))


def parse_family(raw: Any, source: str) -> Family:
    if not isinstance(raw, dict):
        _fail(source, "top level", "must be a mapping")
    unknown = set(raw) - set(_TOP_KEYS)
    if unknown:
        _fail(source, "top level", f"unknown key(s) {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    for key in _REQUIRED:
        if key not in raw:
            _fail(source, "top level", f"missing required key '{key}'")
    for key, typ in _TOP_KEYS.items():
        if key in raw and not isinstance(raw[key], typ):
            _fail(source, key, f"has type {type(raw[key]).__name__}, expected {typ}")
    placement = raw["placement"]
    if isinstance(placement, str):
        if placement not in PLACEMENTS:
            _fail(source, "placement", f"must be one of {PLACEMENTS}, got {placement!r}")
    else:
        if set(placement) != {"attribute", "values"} or not isinstance(placement["values"], dict):
            _fail(source, "placement", "a config-dependent placement is {attribute: NAME, values: {VALUE: pre|post}}")
        placement = {
            "attribute": placement["attribute"],
            "values": {str(k).lower(): v for k, v in placement["values"].items()},
        }
        for v in placement["values"].values():
            if v not in PLACEMENTS:
                _fail(source, "placement.values", f"must be one of {PLACEMENTS}, got {v!r}")
    if not raw["model_types"] or not all(isinstance(m, str) for m in raw["model_types"]):
        _fail(source, "model_types", "must be a non-empty list of transformers model_type strings")
    _check_path(source, "layers", raw["layers"])
    norms = tuple(_norm_entry(source, f"norms[{j}]", n) for j, n in enumerate(raw["norms"]))
    if not norms:
        _fail(source, "norms", "must list at least one norm")
    final = _norm_entry(source, "final_norm", raw["final_norm"]) if raw.get("final_norm") else None
    leave = []
    for j, item in enumerate(raw.get("leave_alone", [])):
        if not isinstance(item, dict) or set(item) != {"pattern", "reason"}:
            _fail(source, f"leave_alone[{j}]", "must be {pattern: REGEX, reason: TEXT}")
        try:
            re.compile(item["pattern"])
        except re.error as e:
            _fail(source, f"leave_alone[{j}].pattern", f"bad regular expression: {e}")
        leave.append(LeaveAlone(item["pattern"], item["reason"]))
    head = raw.get("head")
    if head is not None:
        _check_path(source, "head", head)
    for j, cfg in enumerate(raw.get("test_configs", [])):
        if not isinstance(cfg, dict):
            _fail(source, f"test_configs[{j}]", "must be a mapping of config overrides")
    return Family(
        name=raw["name"],
        display=raw.get("display", raw["name"]),
        model_types=tuple(raw["model_types"]),
        placement=placement,
        layers=raw["layers"],
        embeddings=tuple(_module_entry(source, f"embeddings[{j}]", e) for j, e in enumerate(raw.get("embeddings", []))),
        writers=tuple(_module_entry(source, f"writers[{j}]", e) for j, e in enumerate(raw.get("writers", []))),
        norms=norms,
        final_norm=final,
        head=head,
        head_norms=tuple(_norm_entry(source, f"head_norms[{j}]", n) for j, n in enumerate(raw.get("head_norms", []))),
        leave_alone=tuple(leave),
        notes=raw.get("notes", ""),
        examples=tuple(raw.get("examples", [])),
        test_configs=tuple(raw.get("test_configs", [])),
        source=source,
        centered_inputs=tuple(_paths(source, "centered_inputs", raw.get("centered_inputs", []))),
        stream_biases=tuple(_paths(source, "stream_biases", raw.get("stream_biases", []))),
        stream_scales=tuple(
            _stream_scale(source, f"stream_scales[{j}]", e) for j, e in enumerate(raw.get("stream_scales", []))
        ),
        discovered=bool(raw.get("discovered", False)),
        description=dict(raw) if raw.get("discovered") else None,
    )


def _paths(source, key, paths):
    for j, p in enumerate(paths):
        _check_path(source, f"{key}[{j}]", p)
    return paths


def _stream_scale(source, where, raw) -> StreamScale:
    if not isinstance(raw, dict) or set(raw) != {"scale", "writer"}:
        _fail(source, where, "must be {scale: PARAMETER, writer: MODULE}")
    _check_path(source, where + ".scale", raw["scale"])
    _check_path(source, where + ".writer", raw["writer"])
    return StreamScale(raw["scale"], raw["writer"])
