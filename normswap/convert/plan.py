"""Plan a conversion: from the family data and a model's module tree to per-norm decisions and
per-tensor derivations.

The plan is pure data. Its ``block`` (what the converted module tree looks like) goes into the
checkpoint's config; its ``derivations`` say how every output tensor is computed from source
tensors. Both the in-memory path and the streaming path execute the same plan, so their outputs
are bitwise equal. Only module *types and shapes* are read, so a model built on the meta device
is enough to plan a checkpoint larger than memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from normswap.architectures.schema import Family, NormEntry
from normswap.convert.config import BETA_CHOICES, GAMMA_CHOICES, ConvertOptions
from normswap.errors import NormswapError
from normswap.model_facts import declared_eps, input_embeddings, is_layernorm, layout_of, output_embeddings
from normswap.version import __version__

FORMAT_VERSION = 1


@dataclass
class Plan:
    family: str
    mode: str
    placement: str
    block: dict  # the `normswap` config entry: structure + decisions
    derivations: dict = field(default_factory=dict)  # out key -> op dict (see ops.py)
    drop: list = field(default_factory=list)  # source keys that disappear (folded γ/β)
    aliases: dict = field(default_factory=dict)  # key -> key it is tied to (may be absent on disk)
    notes: list = field(default_factory=list)  # human-readable remarks for the report

    def summary(self) -> dict:
        norms = self.block["norms"]
        return {
            "family": self.family,
            "mode": self.mode,
            "placement": self.placement,
            "norms_replaced": len(norms),
            "gamma": _count(r["gamma"] for r in norms.values()),
            "beta": _count(r["beta"] for r in norms.values()),
            "added_biases": len(self.block["added_biases"]),
            "centered_at_runtime": list(self.block["centered_outputs"]),
            "untied": self.block["untied"],
            "left_alone": self.block["left_alone"],
        }


def _count(values):
    out: dict = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _foldable_layout(module) -> str:
    """How a weight matrix is laid out (model_facts.layout_of), or a refusal for a module convert
    cannot fold into or centre."""
    layout = layout_of(module)
    if layout is None:
        raise NormswapError(f"cannot fold into or centre {type(module).__name__}: only Linear, Conv1D and Embedding are supported")
    return layout


class _Resolver:
    """Expands the family's templated module paths against one concrete model."""

    def __init__(self, family: Family, model, config):
        self.family = family
        self.model = model
        self.config = config
        prefix = getattr(model, "base_model_prefix", "") or ""
        self.base = prefix + "." if prefix and hasattr(model, prefix) and isinstance(getattr(model, prefix), nn.Module) else ""
        layers_path = self.full(family.layers)
        try:
            layers = model.get_submodule(layers_path)
        except AttributeError:
            raise NormswapError(f"{family.name}: layer list '{layers_path}' not found in {type(model).__name__} ({family.source})") from None
        self.n_layers = len(layers)

    def full(self, path: str) -> str:
        """`^name` is relative to the top model (heads); anything else to the base model."""
        return path[1:] if path.startswith("^") else self.base + path

    def applies(self, when: dict) -> bool:
        for attr, want in when.items():
            have = getattr(self.config, attr, None)
            if have != want:
                return False
        return True

    def expand(self, path: str) -> list[str]:
        if "${i}" in path:
            return [self.full(path.replace("${i}", str(i))) for i in range(self.n_layers)]
        return [self.full(path)]

    def exists(self, name: str) -> bool:
        try:
            return self.model.get_submodule(name) is not None
        except AttributeError:
            return False

    def module(self, name: str, optional=False):
        try:
            mod = self.model.get_submodule(name)
        except AttributeError:
            mod = None
        if mod is None and not optional:
            raise NormswapError(
                f"{self.family.name}: module '{name}' not found in {type(self.model).__name__} "
                f"(family data {self.family.source} does not match this transformers version or config)"
            )
        return mod


def _param_key(name, attr="weight"):
    return f"{name}.{attr}"


def _norm_eps(module) -> float:
    eps = declared_eps(module)
    if eps is None:
        raise NormswapError(f"cannot read ε of {type(module).__name__}: no eps attribute")
    return eps


def _norm_hidden(module) -> int:
    shape = getattr(module, "normalized_shape", None)
    if shape is not None:
        shape = tuple(shape)
        if len(shape) != 1:
            raise NormswapError(f"only LayerNorms over the last dimension are supported, got normalized_shape={shape}")
        return int(shape[0])
    w = getattr(module, "weight", None)
    if w is not None:
        return int(w.shape[-1])
    size = getattr(module, "hidden_size", None)
    if size is None:
        raise NormswapError(f"cannot tell the hidden size of {type(module).__name__}")
    return int(size)


def build_plan(family: Family, model, config, options: ConvertOptions, tied: bool | None = None) -> Plan:
    """Decide everything about a conversion, from module types and shapes alone."""
    res = _Resolver(family, model, config)
    placement = family.placement_for(config)
    mode = options.mode
    if mode == "auto":
        mode = "exact" if placement == "pre" else "approx"
    if mode not in ("exact", "approx"):
        raise NormswapError(f"--mode must be exact, approx or auto, got {mode!r}")
    if mode == "exact" and placement == "post":
        raise NormswapError(
            f"{family.display} ({type(model).__name__}) is post-LN: the norm's output is also the residual skip path, "
            "so no exact RMSNorm form exists; run `normswap convert --mode approx` and heal with `normswap finetune`"
        )
    if options.gamma is not None and options.gamma not in GAMMA_CHOICES:
        raise NormswapError(f"--gamma must be one of {GAMMA_CHOICES}")
    if options.beta is not None and options.beta not in BETA_CHOICES:
        raise NormswapError(f"--beta must be one of {BETA_CHOICES}")
    if mode == "exact" and (options.gamma == "reset" or options.beta == "drop"):
        raise NormswapError("--gamma reset and --beta drop discard parameters, so they are not exact: use --mode approx")

    head_module = output_embeddings(model)
    embed_module = input_embeddings(model)
    if tied is None:
        tied = head_module is not None and embed_module is not None and head_module.weight is embed_module.weight
    head_name = _name_of(model, head_module) if head_module is not None else None
    embed_name = _name_of(model, embed_module) if embed_module is not None else None
    untie = bool(options.untie and tied)

    plan = Plan(
        family=family.name,
        mode=mode,
        placement=placement,
        block={
            "format_version": FORMAT_VERSION,
            "normswap_version": __version__,
            "family": family.name,
            "mode": mode,
            "placement": placement,
            "options": options.as_dict(),
            "norms": {},
            "added_biases": {},
            "centered_outputs": [],
            "untied": untie,
            "tied": bool(tied and not untie),
            "left_alone": [],
        },
    )
    if family.centered_inputs:
        plan.block["centered_inputs"] = [n for p in family.centered_inputs for n in res.expand(p) if res.exists(n)]
    if family.discovered:
        # the whole description travels with the checkpoint: `normswap families discover OUT` saves it
        plan.block["discovered_family"] = family.description
    if tied and head_name and embed_name:
        plan.aliases[_param_key(head_name)] = _param_key(embed_name)

    # -- collect the norms that apply to this model ------------------------------------------
    entries: list[tuple[str, NormEntry, str, list]] = []
    for group, role in ((family.norms, "layer"), ((family.final_norm,) if family.final_norm else (), "final"), (family.head_norms, "head")):
        for entry in group:
            if not res.applies(entry.when):
                continue
            names = res.expand(entry.norm)
            for idx, name in enumerate(names):
                if not res.exists(name):
                    if entry.optional or role == "head":
                        continue
                    res.module(name)  # raises with the family file named
                readers = []
                for r in entry.readers:
                    expanded = res.expand(r)
                    readers.append(expanded[idx] if len(expanded) == len(names) else expanded[0])
                entries.append((name, entry, "embedding" if entry.starts_stream else role, readers))

    listed = {name for name, *_ in entries}
    if len(listed) != len(entries):
        raise NormswapError(f"{family.name}: a norm is listed twice for this config ({family.source})")

    # -- every LayerNorm must be listed or explicitly left alone ------------------------------
    for name, module in model.named_modules():
        if not is_layernorm(module) or name in listed:
            continue
        reason = next((la.reason for la in family.leave_alone if re.fullmatch(la.pattern, name)), None)
        if reason is None:
            raise NormswapError(
                f"{family.name}: LayerNorm '{name}' is not described by the family data ({family.source}); refusing to guess"
            )
        plan.block["left_alone"].append({"module": name, "reason": reason})
    for name, *_ in entries:
        if not family.discovered and not is_layernorm(res.module(name)):
            raise NormswapError(f"{family.name}: '{name}' is {type(res.module(name)).__name__}, not a LayerNorm (nothing to convert?)")

    # -- residual-stream writers (exact mode centres them) ------------------------------------
    writer_names: list[str] = []
    embedding_names: list[str] = []
    if mode == "exact":
        for group, bucket in ((family.embeddings, embedding_names), (family.writers, writer_names)):
            for entry in group:
                if not res.applies(entry.when):
                    continue
                for name in res.expand(entry.module):
                    if res.module(name, optional=entry.optional) is not None:
                        bucket.append(name)

    # -- decide γ and β for each norm ---------------------------------------------------------
    reader_ops: dict[str, dict] = {}  # reader module -> {"gamma": key|None, "beta": key|None}
    for name, entry, role, readers in entries:
        module = res.module(name)
        has_w = getattr(module, "weight", None) is not None
        has_b = getattr(module, "bias", None) is not None
        reader_mods = [(r, res.module(r, optional=True)) for r in readers]
        missing = [r for r, m in reader_mods if m is None]
        foldable, why = True, ""
        if placement == "post" and role != "final":
            foldable, why = False, "its output is also the residual skip path (post-LN)"
        elif role == "embedding":
            foldable, why = False, "its output starts the residual stream"
        elif not readers or missing:
            foldable, why = False, "its output leaves the model (no reading linear)" if not readers else f"reader {missing[0]} is absent"
        elif tied and not untie and head_name in readers:
            foldable, why = False, "it feeds the tied output head (use --untie to fold)"
        gamma = options.gamma or ("fold" if foldable else "keep")
        beta = options.beta or ("fold" if foldable else "keep")
        if not foldable:
            if gamma == "fold":
                gamma = "keep"
                plan.notes.append(f"γ of {name} kept, not folded: {why}")
            if beta == "fold":
                beta = "keep"
                plan.notes.append(f"β of {name} kept, not folded: {why}")
        if not has_w:
            gamma = "none"
        if not has_b:
            beta = "none"

        rec = {
            "role": role,
            "hidden_size": _norm_hidden(module),
            "eps": entry.eps if entry.eps is not None else _norm_eps(module),
            "gamma": gamma,
            "beta": beta,
            "weight": gamma in ("keep", "reset"),
            "bias": beta == "keep",
            "readers": readers,
            "source_class": type(module).__name__,
        }
        if why:
            rec["why"] = why
        plan.block["norms"][name] = rec

        wkey, bkey = _param_key(name, "weight"), _param_key(name, "bias")
        if gamma in ("fold", "reset"):
            plan.drop.append(wkey)
        if gamma == "reset":
            plan.derivations[wkey] = {"op": "ones", "size": rec["hidden_size"]}
        if entry.gamma_offset:
            rec["gamma_offset"] = entry.gamma_offset  # γ = weight + offset (LayerNorm1P)
            if gamma == "keep":
                plan.derivations[wkey] = {"op": "add_constant", "src": wkey, "add": entry.gamma_offset}
        if beta in ("fold", "drop"):
            plan.drop.append(bkey)
        if gamma == "fold" or beta == "fold":
            for r, _ in reader_mods:
                ops = reader_ops.setdefault(r, {"gamma": None, "beta": None})
                if ops["gamma"] or ops["beta"]:
                    raise NormswapError(f"{family.name}: {r} reads two norms ({family.source})")
                ops["gamma"] = wkey if gamma == "fold" else None
                ops["beta"] = bkey if beta == "fold" else None
                ops["gamma_offset"] = entry.gamma_offset if gamma == "fold" else 0.0
        if mode == "exact" and role == "embedding":
            plan.block["centered_outputs"].append(name)

    # -- bias vectors added to the stream as they are: centre the vector; layer scales: fold ----
    scale_of: dict[str, str] = {}  # writer Linear -> the λ parameter folded into its rows
    if mode == "exact":
        for path in family.stream_biases:
            for key in res.expand(path):
                size = _vector_size(res, key, family, "stream bias")
                plan.derivations[key] = {"op": "linear_bias", "src": key, "weight": None, "layout": "linear",
                                         "beta": None, "center": True, "size": size}
        for entry in family.stream_scales:
            for key, writer in zip(res.expand(entry.scale), res.expand(entry.writer)):
                size = _vector_size(res, key, family, "layer scale")
                module = res.module(writer)
                if not isinstance(module, nn.Linear) or module.weight.shape[0] != size or writer not in writer_names:
                    raise NormswapError(f"{family.name}: layer scale '{key}' must scale a centred Linear writer's output, "
                                        f"and {writer} is not one ({family.source})")
                scale_of[writer] = key
                plan.derivations[key] = {"op": "ones", "size": size}  # λ now lives in the writer's rows

    # -- embeddings: centre the table, or centre its output at run time when tied ---------------
    for name in embedding_names:
        module = res.module(name)
        weight = getattr(module, "weight", None)
        is_table = isinstance(module, nn.Embedding) and isinstance(weight, nn.Parameter)
        # the tied table may be reachable under more names than get_input_embeddings' (SeamlessM4T's
        # encoder and decoder share it with the head): identity, not the name, says it is the head's
        shares_head = name == embed_name or (embed_module is not None and weight is getattr(embed_module, "weight", None))
        if is_table and not (tied and not untie and shares_head):
            plan.derivations[_param_key(name)] = {"op": "center_rows", "src": _param_key(name)}
        else:
            # tied table (the head must keep the original matrix) or a computed embedding
            # (sinusoidal positions): one reduction per token at run time keeps it exact.
            plan.block["centered_outputs"].append(name)

    # -- linears: fold readers, centre writers --------------------------------------------------
    writer_set = set(writer_names)
    for name in list(reader_ops) + [w for w in writer_names if w not in reader_ops]:
        module = res.module(name)
        if name not in reader_ops and type(module).__name__ != "Conv1D" and not isinstance(module, (nn.Linear, nn.Embedding)):
            # a writer with no weight matrix to centre (a layer scale, a whole embeddings block):
            # its output is centred at run time instead
            plan.block["centered_outputs"].append(name)
            continue
        layout = _foldable_layout(module)
        ops = reader_ops.get(name, {"gamma": None, "beta": None})
        center = name in writer_set
        src_w = _param_key(name)
        if untie and name == head_name and embed_name:
            src_w = _param_key(embed_name)
        has_bias = getattr(module, "bias", None) is not None
        out_features = module.weight.shape[1] if layout == "conv1d" else module.weight.shape[0]
        plan.derivations[_param_key(name)] = {"op": "linear_weight", "src": src_w, "layout": layout, "gamma": ops["gamma"], "center": center}
        if name in scale_of:
            plan.derivations[_param_key(name)]["scale_out"] = scale_of[name]
        if ops.get("gamma_offset"):
            plan.derivations[_param_key(name)]["gamma_offset"] = ops["gamma_offset"]
        if has_bias or ops["beta"]:
            plan.derivations[_param_key(name, "bias")] = {
                "op": "linear_bias",
                "src": _param_key(name, "bias") if has_bias else None,
                "weight": src_w,
                "layout": layout,
                "beta": ops["beta"],
                "center": center,
                "size": int(out_features),
            }
            if name in scale_of:
                plan.derivations[_param_key(name, "bias")]["scale_out"] = scale_of[name]
            if not has_bias:
                plan.block["added_biases"][name] = int(out_features)

    return plan


def _vector_size(res, key, family, what) -> int:
    """The length of the parameter vector ``key`` (a dotted path to a module's attribute)."""
    owner, _, attr = key.rpartition(".")
    param = getattr(res.module(owner), attr, None)
    if not isinstance(param, nn.Parameter) or param.dim() != 1:
        raise NormswapError(f"{family.name}: {what} '{key}' is not a parameter vector ({family.source})")
    return int(param.shape[0])


def _name_of(model, target) -> str | None:
    for name, module in model.named_modules():
        if module is target:
            return name
    return None
