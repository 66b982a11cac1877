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
            "logits_bias": dict(self.block.get("logits_bias", {})),
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
        raise NormswapError(
            f"cannot fold into or centre {type(module).__name__}: only Linear, Conv1D and Embedding are supported"
        )
    return layout


class _Resolver:
    """Expands the family's templated module paths against one concrete model."""

    def __init__(self, family: Family, model, config):
        self.family = family
        self.model = model
        self.config = config
        prefix = getattr(model, "base_model_prefix", "") or ""
        self.base = (
            prefix + "." if prefix and hasattr(model, prefix) and isinstance(getattr(model, prefix), nn.Module) else ""
        )
        layers_path = self.full(family.layers)
        try:
            layers = model.get_submodule(layers_path)
        except AttributeError:
            raise NormswapError(
                f"{family.name}: layer list '{layers_path}' not found in {type(model).__name__} ({family.source})"
            ) from None
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
    """Decide everything about a conversion, from module types and shapes alone.

    Each step below adds to the plan: which norms this model has (each described or left alone),
    which modules write the residual stream (exact mode centres them), what happens to each norm's
    γ and β, then the derivations of the stream's bias vectors and layer scales, of the embeddings
    and of the linears that read a norm or write the stream. ``tied`` overrides whether the output
    head shares the input embedding's matrix (read from the model otherwise).
    """
    res = _Resolver(family, model, config)
    placement = family.placement_for(config)
    mode = _mode(family, model, placement, options)
    ties = _Ties.of(model, options, tied)
    plan = _empty_plan(family, res, mode, placement, options, ties)
    entries = _norm_entries(family, res)
    _check_every_layernorm_is_described(plan, family, model, res, entries)
    embedding_names, writer_names = _stream_writers(family, res) if mode == "exact" else ([], [])
    reader_ops = _decide_gamma_and_beta(plan, res, entries, options, placement, ties)
    scale_of = _stream_biases_and_scales(plan, family, res, writer_names) if mode == "exact" else {}
    _centre_embeddings(plan, res, embedding_names, ties)
    _fold_readers_and_centre_writers(plan, res, reader_ops, writer_names, scale_of, ties)
    _fold_beta_into_logits_bias(plan, ties)
    if mode == "exact":
        plan.block["stream_writers"] = _stream_writer_record(plan, scale_of)
    return plan


def _stream_writer_record(plan: Plan, scale_of: dict[str, str]) -> dict:
    """What keeps this exact conversion exact, for whoever changes its weights later (the
    fine-tune projects back onto it after each step, the stock export checks it): every tensor
    this plan centred, with the axis its mean is taken over ({key: dim}), and the layer scales it
    set to ones (their λ now lives in the writer's rows)."""
    zero_mean = {}
    for key, op in plan.derivations.items():
        if op["op"] == "center_rows":
            zero_mean[key] = -1
        elif op["op"] == "linear_weight" and op.get("center"):
            zero_mean[key] = 0 if op["layout"] == "linear" else -1  # [out, in] vs Conv1D's [in, out]
        elif op["op"] == "linear_bias" and op.get("center"):
            zero_mean[key] = -1
    return {"zero_mean": zero_mean, "unit_scales": sorted(scale_of.values())}


def _mode(family: Family, model, placement: str, options: ConvertOptions) -> str:
    """``auto`` resolved by the family's placement; refusals of what cannot be exact."""
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
        raise NormswapError(
            "--gamma reset and --beta drop discard parameters, so they are not exact: use --mode approx"
        )
    return mode


@dataclass
class _Ties:
    """The output head and the input embedding, and whether they share one matrix (and stay so)."""

    head_module: object
    embed_module: object
    head_name: str | None
    embed_name: str | None
    tied: bool
    untie: bool

    @classmethod
    def of(cls, model, options: ConvertOptions, tied: bool | None) -> _Ties:
        head, embed = output_embeddings(model), input_embeddings(model)
        if tied is None:
            tied = head is not None and embed is not None and head.weight is embed.weight
        return cls(
            head,
            embed,
            _name_of(model, head) if head is not None else None,
            _name_of(model, embed) if embed is not None else None,
            bool(tied),
            bool(options.untie and tied),
        )

    @property
    def kept(self) -> bool:
        """The head stays tied to the embedding (so neither may change alone)."""
        return self.tied and not self.untie


def _empty_plan(
    family: Family, res: _Resolver, mode: str, placement: str, options: ConvertOptions, ties: _Ties
) -> Plan:
    """The plan's header: the `normswap` config block before any norm is decided."""
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
            "untied": ties.untie,
            "tied": ties.kept,
            "logits_bias": {},  # tied head -> the norm whose β it holds as W·β (_fold_beta_into_logits_bias)
            "left_alone": [],
        },
    )
    if family.centered_inputs:
        plan.block["centered_inputs"] = [n for p in family.centered_inputs for n in res.expand(p) if res.exists(n)]
    if family.discovered:
        # the whole description travels with the checkpoint: `normswap families discover OUT` saves it
        plan.block["discovered_family"] = family.description
    if ties.tied and ties.head_name and ties.embed_name:
        plan.aliases[_param_key(ties.head_name)] = _param_key(ties.embed_name)
    return plan


def _norm_entries(family: Family, res: _Resolver) -> list[tuple[str, NormEntry, str, list]]:
    """(module name, family entry, role, reader names) of every norm the family lists that this
    model (its config, its layer count) has; role is layer, final, head or embedding."""
    entries: list[tuple[str, NormEntry, str, list]] = []
    for group, role in (
        (family.norms, "layer"),
        ((family.final_norm,) if family.final_norm else (), "final"),
        (family.head_norms, "head"),
    ):
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
    if len({name for name, *_ in entries}) != len(entries):
        raise NormswapError(f"{family.name}: a norm is listed twice for this config ({family.source})")
    return entries


def _check_every_layernorm_is_described(plan: Plan, family: Family, model, res: _Resolver, entries) -> None:
    """Every LayerNorm must be listed or explicitly left alone (recorded with its reason), and every
    listed norm of a curated family must be a LayerNorm: never guess."""
    listed = {name for name, *_ in entries}
    for name, module in model.named_modules():
        if not is_layernorm(module) or name in listed:
            continue
        reason = next((la.reason for la in family.leave_alone if re.fullmatch(la.pattern, name)), None)
        if reason is None:
            raise NormswapError(
                f"{family.name}: LayerNorm '{name}' is not described "
                f"by the family data ({family.source}); refusing to guess"
            )
        plan.block["left_alone"].append({"module": name, "reason": reason})
    for name, *_ in entries:
        if not family.discovered and not is_layernorm(res.module(name)):
            raise NormswapError(
                f"{family.name}: '{name}' is {type(res.module(name)).__name__}, not a LayerNorm (nothing to convert?)"
            )


def _stream_writers(family: Family, res: _Resolver) -> tuple[list[str], list[str]]:
    """(embeddings, writers): the modules whose outputs are added to the residual stream."""
    writer_names: list[str] = []
    embedding_names: list[str] = []
    for group, bucket in ((family.embeddings, embedding_names), (family.writers, writer_names)):
        for entry in group:
            if not res.applies(entry.when):
                continue
            for name in res.expand(entry.module):
                if res.module(name, optional=entry.optional) is not None:
                    bucket.append(name)
    return embedding_names, writer_names


def _decide_gamma_and_beta(
    plan: Plan, res: _Resolver, entries, options: ConvertOptions, placement: str, ties: _Ties
) -> dict[str, dict]:
    """Record each norm's decisions (γ and β folded, kept, reset or dropped) and return what each
    reading linear folds in: {reader module: {"gamma": key|None, "beta": key|None, "gamma_offset"}}."""
    family = res.family
    reader_ops: dict[str, dict] = {}
    for name, entry, role, readers in entries:
        module = res.module(name)
        has_w = getattr(module, "weight", None) is not None
        has_b = getattr(module, "bias", None) is not None
        reader_mods = [(r, res.module(r, optional=True)) for r in readers]
        missing = [r for r, m in reader_mods if m is None]
        foldable, why, through_head = True, "", False
        if placement == "post" and role != "final":
            foldable, why = False, "its output is also the residual skip path (post-LN)"
        elif role == "embedding":
            foldable, why = False, "its output starts the residual stream"
        elif not readers or missing:
            foldable, why = (
                False,
                "its output leaves the model (no reading linear)" if not readers else f"reader {missing[0]} is absent",
            )
        elif ties.kept and ties.head_name in readers:
            foldable, why = False, "it feeds the tied output head (use --untie to fold)"
            through_head = has_b and options.beta in (None, "fold") and _beta_fits_logits_bias(res, ties, name, readers)
            if through_head:
                why = "it feeds the tied output head: γ kept (use --untie to fold it), β folded into the logits bias"
        gamma = options.gamma or ("fold" if foldable else "keep")
        beta = options.beta or ("fold" if foldable or through_head else "keep")
        if not foldable:
            if gamma == "fold":
                gamma = "keep"
                plan.notes.append(f"γ of {name} kept, not folded: {why}")
            if beta == "fold" and not through_head:
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
        if through_head:
            rec["logits_bias"] = ties.head_name  # β becomes the head's bias W·β (_fold_beta_into_logits_bias)
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
        if beta == "keep" and gamma == "fold":
            # the readers now scale the RMSNorm's output by γ, its bias included: it must be β/γ
            plan.derivations[bkey] = {"op": "divide_by_gamma", "src": bkey, "gamma": wkey}
            if entry.gamma_offset:
                plan.derivations[bkey]["gamma_offset"] = entry.gamma_offset
        if res.base and name.startswith(res.base) and readers and not any(r.startswith(res.base) for r in readers):
            # folded into a head only (ln_f into lm_head): the bare model and every other head read
            # this norm's output as the original had it, so its γ/β travel along as folded_weight /
            # folded_bias, which those classes apply and the folding class only carries (remote_code.py)
            for attr, kind, key in (("weight", gamma, wkey), ("bias", beta, bkey)):
                if kind == "fold":
                    offset = entry.gamma_offset if attr == "weight" else 0.0
                    plan.derivations[_param_key(name, f"folded_{attr}")] = (
                        {"op": "add_constant", "src": key, "add": offset} if offset else {"op": "copy", "src": key}
                    )
                    rec.setdefault("restore", []).append(attr)
        if gamma == "fold" or (beta == "fold" and not through_head):
            for r, _ in reader_mods:
                ops = reader_ops.setdefault(r, {"gamma": None, "beta": None})
                if ops["gamma"] or ops["beta"]:
                    raise NormswapError(f"{family.name}: {r} reads two norms ({family.source})")
                ops["gamma"] = wkey if gamma == "fold" else None
                ops["beta"] = bkey if beta == "fold" else None
                ops["gamma_offset"] = entry.gamma_offset if gamma == "fold" else 0.0
        if plan.mode == "exact" and role == "embedding":
            plan.block["centered_outputs"].append(name)
    return reader_ops


def _beta_fits_logits_bias(res: _Resolver, ties: _Ties, name: str, readers: list[str]) -> bool:
    """Whether the β of norm ``name``, which feeds the tied head, can become that head's bias: the
    norm's only reader is the head, an nn.Linear without a bias of its own (so the logits bias is
    W·β alone), and the norm sits in the base model while the head does not, so that the bare model
    and every other head can apply β themselves (``folded_bias``, remote_code.py)."""
    head = ties.head_module
    return (
        readers == [ties.head_name]
        and isinstance(head, nn.Linear)
        and head.bias is None
        and bool(res.base)
        and name.startswith(res.base)
        and not ties.head_name.startswith(res.base)
    )


def _fold_beta_into_logits_bias(plan: Plan, ties: _Ties) -> None:
    """β of a final norm that feeds the tied head, folded through the head into a logits bias:
    (n·γ + β)·Wᵀ = (n·γ)·Wᵀ + W·β. The head's matrix stays the embedding's, γ stays on the norm
    (inside the norm's kernel), and W·β (float64, ops.py) rides in the head's matmul as its bias, so
    the causal LM runs no separate bias add after its last norm. The norm's β itself travels as
    ``folded_bias``: the bare model and every other head apply it, and the causal LM derives its
    logits bias from it while training (remote_code.py). ``--beta keep`` keeps β on the norm instead."""
    for name, rec in plan.block["norms"].items():
        head = rec.get("logits_bias")
        if head is None:
            continue
        plan.derivations[_param_key(head, "bias")] = {
            "op": "linear_bias",
            "src": None,
            "weight": _param_key(head),  # the tied table (plan.aliases), uncentred: the head's W
            "layout": "linear",
            "beta": _param_key(name, "bias"),
            "center": False,
            "size": int(ties.head_module.weight.shape[0]),
        }
        plan.block["logits_bias"][head] = name
        plan.notes.append(f"β of {name} folded into the logits bias through the tied head ({head}.bias = W·β)")


def _stream_biases_and_scales(plan: Plan, family: Family, res: _Resolver, writer_names: list[str]) -> dict[str, str]:
    """Bias vectors added to the stream as they are: centred. Layer scales: folded into their
    writer's rows (returned as {writer Linear: the λ parameter})."""
    scale_of: dict[str, str] = {}
    for path in family.stream_biases:
        for key in res.expand(path):
            size = _vector_size(res, key, family, "stream bias")
            plan.derivations[key] = {
                "op": "linear_bias",
                "src": key,
                "weight": None,
                "layout": "linear",
                "beta": None,
                "center": True,
                "size": size,
            }
    for entry in family.stream_scales:
        for key, writer in zip(res.expand(entry.scale), res.expand(entry.writer)):
            size = _vector_size(res, key, family, "layer scale")
            module = res.module(writer)
            if not isinstance(module, nn.Linear) or module.weight.shape[0] != size or writer not in writer_names:
                raise NormswapError(
                    f"{family.name}: layer scale '{key}' must scale a centred Linear writer's output, "
                    f"and {writer} is not one ({family.source})"
                )
            scale_of[writer] = key
            plan.derivations[key] = {"op": "ones", "size": size}  # λ now lives in the writer's rows
    return scale_of


def _centre_embeddings(plan: Plan, res: _Resolver, embedding_names: list[str], ties: _Ties) -> None:
    """Centre each embedding table's rows, or its output at run time when the table is tied to the
    head or computed."""
    for name in embedding_names:
        module = res.module(name)
        weight = getattr(module, "weight", None)
        is_table = isinstance(module, nn.Embedding) and isinstance(weight, nn.Parameter)
        # the tied table may be reachable under more names than get_input_embeddings' (SeamlessM4T's
        # encoder and decoder share it with the head): identity, not the name, says it is the head's
        shares_head = name == ties.embed_name or (
            ties.embed_module is not None and weight is getattr(ties.embed_module, "weight", None)
        )
        if is_table and not (ties.kept and shares_head):
            plan.derivations[_param_key(name)] = {"op": "center_rows", "src": _param_key(name)}
        else:
            # tied table (the head must keep the original matrix) or a computed embedding
            # (sinusoidal positions): one reduction per token at run time keeps it exact.
            plan.block["centered_outputs"].append(name)


def _fold_readers_and_centre_writers(
    plan: Plan, res: _Resolver, reader_ops: dict, writer_names: list[str], scale_of: dict[str, str], ties: _Ties
) -> None:
    """The linears: γ/β folded into the readers' weights and biases, the writers' rows centred
    (with their layer scale folded in)."""
    writer_set = set(writer_names)
    for name in list(reader_ops) + [w for w in writer_names if w not in reader_ops]:
        module = res.module(name)
        if name not in reader_ops and layout_of(module) is None:
            # a writer with no weight matrix to centre (a layer scale, a whole embeddings block):
            # its output is centred at run time instead
            plan.block["centered_outputs"].append(name)
            continue
        layout = _foldable_layout(module)
        ops = reader_ops.get(name, {"gamma": None, "beta": None})
        center = name in writer_set
        src_w = _param_key(name)
        if ties.untie and name == ties.head_name and ties.embed_name:
            src_w = _param_key(ties.embed_name)
        has_bias = getattr(module, "bias", None) is not None
        out_features = module.weight.shape[1] if layout == "conv1d" else module.weight.shape[0]
        plan.derivations[_param_key(name)] = {
            "op": "linear_weight",
            "src": src_w,
            "layout": layout,
            "gamma": ops["gamma"],
            "center": center,
        }
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
