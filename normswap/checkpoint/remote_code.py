# normswap: structure of a converted checkpoint.
#
# This file has two lives. Inside the package, convert imports it to rebuild a model's module
# tree in memory. Its text is also written, below a two-line header that imports the source
# model's classes, into every converted checkpoint as `modeling_normswap.py`, so that stock
# `transformers` (trust_remote_code=True) rebuilds exactly the same tree before the weights load,
# with no normswap installed. So: standard library, torch and transformers only, outside the
# guarded import below. normswap itself never imports a checkpoint's copy: it builds the same
# classes from this file (normswap_classes), so a replaced modeling_normswap.py never runs.
import os
import warnings

import torch
from torch import nn

try:  # the fused kernels when normswap is installed
    from normswap.kernels import centered_rows as _centered_rows
    from normswap.modules import RMSNorm
except ImportError:  # a plain torch RMSNorm with the same parameter names

    def _centered_rows(table, ids):
        return None  # no compiled lookup: _CenteredEmbedding computes the formula

    class RMSNorm(nn.Module):
        def __init__(self, hidden_size, eps=1e-5, elementwise_affine=True, bias=False, device=None, dtype=None):
            super().__init__()
            self.hidden_size = int(hidden_size)
            self.eps = float(eps)
            factory = {"device": device, "dtype": dtype}
            self.weight = nn.Parameter(torch.ones(self.hidden_size, **factory)) if elementwise_affine else None
            self.bias = nn.Parameter(torch.zeros(self.hidden_size, **factory)) if bias else None

        def forward(self, x, residual=None):
            if residual is not None:
                x = x + residual
            xf = x.float()
            y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
            if self.weight is not None:
                y = y * self.weight
            if self.bias is not None:
                y = y + self.bias
            return (y, x) if residual is not None else y


def _center_output_hook(module, args, output):
    # Keeps what this module writes into the residual stream zero-mean along the hidden size,
    # which is what makes every RMSNorm downstream equal the LayerNorm it replaced.
    return output - output.mean(dim=-1, keepdim=True)


class _CenteredEmbedding(nn.Embedding):
    """A token embedding whose output is centred along the hidden size: what the output-centring
    hook does, for a table that must stay uncentred in its weights (tied to the output head).

    Decoding looks up one row per token, so the hook's cost (the module's hooked call path, a
    mean and a subtraction: about as much as the lookup itself) was a visible share of a small
    model's step. Without a gradient, on CPU where normswap's compiled kernel is available, one
    C++ call looks the rows up and centres them; elsewhere the per-row means are kept (one number
    per row, recomputed when the table changes in place or moves) and subtracted in place from the
    looked-up rows;
    with a gradient, under torch.compile, or with max_norm, the plain formula runs. The module
    keeps nn.Embedding's parameters and state-dict keys (only its class changes), so tying,
    saving and loading are as before."""

    _row_means = None
    _row_means_of = None

    def forward(self, input):
        # the dict read directly: ``self.weight`` is a Python-level __getattr__ per token
        w = self._parameters.get("weight")
        if w is None:  # a parametrized weight takes the ordinary lookup
            w = self.weight
        if self.max_norm is not None or torch.compiler.is_compiling() or (torch.is_grad_enabled() and w.requires_grad):
            out = super().forward(input)
            return out - out.mean(dim=-1, keepdim=True)
        # on CPU with normswap's compiled kernel: the lookup and its centring in one call (three
        # ATen ops cost ~2.5x a plain lookup at width 96: dispatch, not arithmetic)
        out = _centered_rows(w, input)
        if out is not None:
            return out
        out = super().forward(input)
        # _version counts in-place changes (optimizer steps, load_state_dict's copy_)
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        if self._row_means_of != key:
            self._row_means = w.detach().mean(dim=-1, keepdim=True)
            self._row_means_of = key
        return out.sub_(torch.nn.functional.embedding(input, self._row_means))


def _center_input_hook(module, args, kwargs):
    # The same for a stream start no single module writes (discovered families): centre the
    # hidden states where the first layer reads them.
    if args and isinstance(args[0], torch.Tensor):
        return (args[0] - args[0].mean(dim=-1, keepdim=True),) + tuple(args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        h = kwargs["hidden_states"]
        return args, {**kwargs, "hidden_states": h - h.mean(dim=-1, keepdim=True)}
    return None


def local_name(model, name):
    """Names are recorded on the class that was converted (e.g. `bert.encoder...` in
    BertForMaskedLM); the bare model class (AutoModel) holds the same modules without the
    prefix and none of the head's, and a head class holds a converted bare model's modules
    under the prefix. Returns None for a module this model does not have."""
    prefix = getattr(model, "base_model_prefix", "")
    # the class that was converted may wrap this one under its own prefix (CLIPVisionModelWithProjection
    # holds CLIPVisionModel's modules under vision_model., whatever CLIPVisionModel's own prefix is)
    converted = getattr(__import__("transformers"), str(_block_of(model).get("source_class")), None)
    wrapper = getattr(converted, "base_model_prefix", "")
    candidates = [name]
    if prefix and not hasattr(model, prefix) and name.startswith(prefix + "."):
        candidates = [name[len(prefix) + 1 :]]
    elif wrapper and wrapper != prefix and not hasattr(model, wrapper) and name.startswith(wrapper + "."):
        candidates = [name[len(wrapper) + 1 :]]
    elif prefix and isinstance(getattr(model, prefix, None), nn.Module) and not name.startswith(prefix + "."):
        candidates.append(f"{prefix}.{name}")
    for candidate in candidates:
        try:
            model.get_submodule(candidate)
        except AttributeError:
            continue
        return candidate
    return None


def _block_of(model) -> dict:
    block = getattr(getattr(model, "config", None), "normswap", None)
    return block if isinstance(block, dict) else {}


def _parent_and_attr(model, name):
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    return parent, attr


def _factory_kwargs(model, module):
    for p in list(module.parameters(recurse=False)) + list(model.parameters()):
        return {"device": p.device, "dtype": p.dtype}
    return {}


def _restore_folded_hook(module, args, output):
    # γ/β of a norm that the conversion folded into a head this class does not have (ln_f into
    # lm_head, seen from the bare model or another head): applied here, so that what this class
    # reads is the original's hidden state.
    y = output[0] if isinstance(output, tuple) else output
    weight, bias = getattr(module, "folded_weight", None), getattr(module, "folded_bias", None)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return (y,) + tuple(output[1:]) if isinstance(output, tuple) else y


class _LogitsBiasHead(nn.Linear):
    """A tied output head whose bias holds W·β, β being the final norm's (convert folded it there:
    (n·γ + β)·Wᵀ = (n·γ)·Wᵀ + W·β), so the bias add rides in the head's matmul and the last norm
    runs without one.

    The bias is derived state, not a parameter: the norm keeps β as one (``folded_bias``, what the
    bare model and every other head add). Training (train mode, with a gradient) adds β to the
    head's input as the original did, so β and the tied W get the original's gradients at the
    original's cost (one add; W·β in the graph would cost passes over the vocab x hidden matrix).
    Otherwise the stored bias runs, derived again (float64, in row blocks) whenever W or β is no
    longer what it was derived from: their version counters and storages, read per forward (eager),
    catch a load, an optimizer step, an in-place edit, a resize or a move; a training forward marks
    it stale for compiled code; loading and every state dict (so every save) derive it first. Only a
    change through ``.data``, which autograd does not count, goes unseen until a save or a reload.
    The module keeps nn.Linear's forward signature and state-dict keys (only its class changes, and
    ``bias`` is a persistent buffer)."""

    _beta_of = None  # the norm whose ``folded_bias`` is β (a plain attribute, not a submodule)
    _stale = False  # a training forward ran since the bias was derived (what compiled code checks)
    _derived_from = None  # _source() of the W and β the bias was derived from
    _stored = False  # run the stored bias as it is (convert's verification checks the stored values)

    def _source(self):
        # the parameter dicts read directly: a module attribute costs a Python-level __getattr__
        w, beta = self._parameters["weight"], self._beta_of._parameters["folded_bias"]
        return (w._version, w.data_ptr(), w.device, beta._version, beta.data_ptr())

    def forward(self, input):
        # this runs once per generated token, where every Python call counts: the parameter and
        # buffer dicts are read directly (``self.weight`` is a Python-level __getattr__; a
        # parametrized weight is not in the dict and takes the ordinary lookup), and _source() is
        # written out
        w = self._parameters.get("weight")
        if w is None:
            w = self.weight
        if self.training and torch.is_grad_enabled():
            self._stale = True
            return torch.nn.functional.linear(input + self._beta_of.folded_bias, w)
        if not self._stored and (self._stale or not torch.compiler.is_compiling()):
            beta = self._beta_of._parameters["folded_bias"]
            if self._stale or self._derived_from != (
                w._version,
                w.data_ptr(),
                w.device,
                beta._version,
                beta.data_ptr(),
            ):
                self.derive_bias()
        return torch.nn.functional.linear(input, w, self._buffers["bias"])

    @torch.compiler.disable
    @torch.no_grad()
    def derive_bias(self):
        w, beta = self.weight, self._beta_of.folded_bias.to(torch.float64)
        step = max(1, (1 << 20) // max(1, w.shape[1]))  # ~8 MB of float64 rows at a time
        for a in range(0, w.shape[0], step):
            self.bias[a : a + step] = w[a : a + step].to(torch.float64) @ beta
        self._stale, self._derived_from = False, self._source()


def _derive_before_saving(module, prefix, keep_vars):
    if not module._stored and (module._stale or module._derived_from != module._source()):
        module.derive_bias()


def derive_logits_biases(model):
    """Derive every _LogitsBiasHead's bias from the W and β the model holds now (after loading: a class
    may initialise the head's matrix anew, as MBartForCausalLM does from an MBartForConditionalGeneration
    checkpoint, whose stored W·β belongs to another W). Weights not materialised yet (the meta device)
    are left for the first forward."""
    for module in model.modules():
        if isinstance(module, _LogitsBiasHead) and not (module.weight.is_meta or module.bias.is_meta):
            module.derive_bias()


def run_stored_logits_biases(model):
    """Make every _LogitsBiasHead run its bias as stored, never derived: for a model whose weights are
    swapped in per module (convert/verify.py), where β is not resident when the head runs and what
    must be checked is the stored W·β itself."""
    for module in model.modules():
        if isinstance(module, _LogitsBiasHead):
            module._stored = True


def _head_takes_beta(model, head_name, norm):
    """The head (LM class) turned into a _LogitsBiasHead reading β from ``norm``; its bias a buffer."""
    head = model.get_submodule(head_name)
    factory = {"device": head.weight.device, "dtype": head.weight.dtype}
    head.__class__ = _LogitsBiasHead
    head._parameters.pop("bias", None)
    head.register_buffer("bias", torch.zeros(head.weight.shape[0], **factory), persistent=True)
    object.__setattr__(head, "_beta_of", norm)  # not a submodule: the norm already is one, elsewhere
    head.register_state_dict_pre_hook(_derive_before_saving)


def carried_keys(block):
    """State-dict keys of the γ/β copies the folding class only carries (``restore``): not part of
    its function, so an export of that class leaves them out."""
    return {f"{name}.folded_{attr}" for name, rec in block.get("norms", {}).items() for attr in rec.get("restore", [])}


def _carry_folded_affine(model, norm, rec, factory):
    """``folded_weight`` / ``folded_bias`` on a norm whose γ/β went into a head only (``restore``).

    The class holding that head (every reader present) carries them as persistent buffers, unused,
    so a save keeps them; any other class (AutoModel, a new task head) owns them as parameters,
    trainable like the original's γ/β, and applies them to the norm's output. A β the tied head
    holds as its logits bias (``logits_bias``) is a parameter in the head's class too: that head
    derives its bias from it (_LogitsBiasHead)."""
    folding = all(local_name(model, r) is not None for r in rec.get("readers", []))
    for attr in rec["restore"]:
        value = torch.zeros(int(rec["hidden_size"]), **factory)
        if folding and not (attr == "bias" and rec.get("logits_bias")):
            norm.register_buffer(f"folded_{attr}", value, persistent=True)
        else:
            norm.register_parameter(f"folded_{attr}", nn.Parameter(value))
    if not folding:
        norm.register_forward_hook(_restore_folded_hook)
    elif rec.get("logits_bias"):
        _head_takes_beta(model, local_name(model, rec["logits_bias"]), norm)


def _within(size, limit, field):
    """Refuse a size from the config's normswap block larger than the module it belongs to, as built.

    normswap itself checks every such size against the weights' headers before it builds anything
    (normswap/checkpoint/sizes.py); this is the bound that holds where this file runs alone (stock
    transformers, trust_remote_code=True): what it builds stays within what the source class built
    from the config's own sizes, instead of whatever a few bytes of JSON ask for (2 GB for one bias,
    160 GB for a head adapter)."""
    if limit is not None and int(size) > int(limit):
        raise ValueError(
            f"{field} is {int(size):,}, larger than the module it belongs to ({int(limit):,}): the config is damaged"
        )


def _width_of(norm):
    # the features a norm normalises, as the source class built it (a LayerNorm, or a norm with a weight)
    shape = getattr(norm, "normalized_shape", None)
    if shape:
        return shape[-1]
    weight = getattr(norm, "weight", None)
    return weight.shape[-1] if isinstance(weight, torch.Tensor) and weight.dim() else None


def _outputs_of(module):
    # a linear's output features: nn.Linear's weight is [out, in], transformers' Conv1D's [in, out]
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return 0  # nothing a bias could be added to
    return weight.shape[1] if type(module).__name__ == "Conv1D" else weight.shape[0]


def apply_normswap_structure(model, block):
    """Turn a freshly built source-architecture model into the converted module tree.

    ``block`` is the ``normswap`` entry of the converted config: which norms became RMSNorm
    (with or without weight and bias), which linears gained a bias (β folded into a reader that
    had none), which modules have their output centred at run time, and whether the head was
    untied. Module names never change, so state-dict keys and weight tying stay as they were.
    """
    for name, rec in block.get("norms", {}).items():
        name = local_name(model, name)
        if name is None:
            continue
        parent, attr = _parent_and_attr(model, name)
        old = getattr(parent, attr)
        _within(rec["hidden_size"], _width_of(old), f"normswap.norms[{name!r}].hidden_size")
        factory = _factory_kwargs(model, old)
        new = RMSNorm(rec["hidden_size"], eps=rec["eps"], elementwise_affine=rec["weight"], bias=rec["bias"], **factory)
        new.train(old.training)
        setattr(parent, attr, new)
        if rec.get("restore"):
            _carry_folded_affine(model, new, rec, factory)
    for name, size in block.get("added_biases", {}).items():
        name = local_name(model, name)
        if name is None:
            continue
        module = model.get_submodule(name)
        if getattr(module, "bias", None) is None:
            _within(size, _outputs_of(module), f"normswap.added_biases[{name!r}]")
            factory = _factory_kwargs(model, module)
            module.bias = nn.Parameter(torch.zeros(int(size), **factory))
    if block.get("untied") and hasattr(model, "get_output_embeddings"):
        head = model.get_output_embeddings()
        embed = model.get_input_embeddings()
        if head is not None and embed is not None and head.weight is embed.weight:
            head.weight = nn.Parameter(head.weight.detach().clone())
    register_runtime_centering(model, block)
    apply_slice_structure(model, block)
    return model


class _SlicedTiedHead(nn.Linear):
    """The tied output head of a sliced model whose final norm had a γ (normswap slice).

    γ does not commute with the rotation Q, so it moves here: with y' the final norm's k-wide
    output, logits = (y'·R)·E'ᵀ + (y'·g)·m + b, where E' = E·Q_k is the tied (sliced) table,
    R = c·Q_kᵀ·diag(γ)·Q_k (k × k), g = c·Q_kᵀ·diag(γ)·u (k), m = E·u (the original table's rows
    along the all-ones direction u, vocab), b = E·β (the final norm's β through the original
    table) and c = sqrt(d/k) the norm-width gain. Exact when only u is deleted; with more columns
    deleted it drops γ's mixing of kept into deleted directions, an error of the slice's own kind.
    k² + k + 2·vocab parameters instead of untying (vocab × k). All four are ordinary parameters, so
    a fine-tune trains them with the table."""

    def forward(self, input):
        out = torch.nn.functional.linear(torch.matmul(input, self.adapter), self.weight, self.bias)
        # the rank-one term added in place: one pass over the logits, no vocabulary-wide temporaries
        # (linear's backward does not read its output, so autograd allows it)
        return out.addcmul_(torch.matmul(input, self.adapter_u).unsqueeze(-1), self.row_means)


def _narrowed_attributes(module):
    # the size attributes a module keeps beside its weight, read from the weight's new shape
    w = module.weight
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = int(w.shape[0]), int(w.shape[1])
    elif isinstance(module, nn.Embedding):
        module.embedding_dim = int(w.shape[1])
    elif type(module).__name__ == "Conv1D":  # transformers' GPT-2 style linear, weight [in, out]
        module.nx, module.nf = int(w.shape[0]), int(w.shape[1])


def apply_slice_structure(model, block):
    """Narrow a freshly built model to a sliced residual stream (``block["slice"]``, written by
    normswap slice): every parameter listed in ``stream_dims`` loses the deleted stream columns
    along the listed axes (hidden size d -> width k), the module's size attributes follow, a tied
    head whose final norm kept γ becomes a _SlicedTiedHead, and a tied head is tied again to the
    narrowed table. The norms themselves are already built k wide from their records. Sizes only
    shrink: a width outside 1..d along any listed axis is refused (the config is damaged)."""
    info = block.get("slice")
    if not isinstance(info, dict):
        return model
    width = info.get("width")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"normswap.slice.width must be a whole number above zero, got {width!r}")
    for key, axes in info.get("stream_dims", {}).items():
        owner, _, attr = key.rpartition(".")
        name = local_name(model, owner) if owner else None
        if name is None:
            continue
        module = model.get_submodule(name)
        old = getattr(module, attr, None)
        if not isinstance(old, torch.Tensor):
            raise ValueError(f"normswap.slice names {key}, which this model does not hold as a tensor")
        shape = list(old.shape)
        for axis in axes:
            if not -len(shape) <= int(axis) < len(shape) or width > shape[int(axis)]:
                raise ValueError(f"normswap.slice narrows {key} {tuple(old.shape)} to width {width} along {axis}")
            shape[int(axis)] = width
        new = torch.zeros(shape, dtype=old.dtype, device=old.device)
        if isinstance(old, nn.Parameter):
            setattr(module, attr, nn.Parameter(new, requires_grad=old.requires_grad))
        else:
            module.register_buffer(attr, new)
        if attr == "weight":
            _narrowed_attributes(module)
    norm = info.get("embedding_norm")
    norm_name = local_name(model, norm) if isinstance(norm, str) else None
    if norm_name is not None:  # its output is precomputed into the (sliced) token table
        parent, attr = _parent_and_attr(model, norm_name)
        setattr(parent, attr, nn.Identity())
    adapter = info.get("head_adapter")
    head_name = local_name(model, adapter["head"]) if isinstance(adapter, dict) else None
    if head_name is not None:
        head = model.get_submodule(head_name)
        _within(width, head.weight.shape[-1], "normswap.slice.width (the head adapter's)")
        vocab = int(head.weight.shape[0])
        factory = {"device": head.weight.device, "dtype": head.weight.dtype}
        head.__class__ = _SlicedTiedHead
        head._parameters.pop("bias", None)
        head._buffers.pop("bias", None)
        head.adapter = nn.Parameter(torch.zeros(width, width, **factory))
        head.adapter_u = nn.Parameter(torch.zeros(width, **factory))
        head.row_means = nn.Parameter(torch.zeros(vocab, **factory))
        head.bias = nn.Parameter(torch.zeros(vocab, **factory))
    if block.get("tied") and hasattr(model, "get_output_embeddings"):
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        if head is not None and embed is not None and head.weight is not embed.weight:
            head.weight = embed.weight
            _narrowed_attributes(head)
    return model


def register_runtime_centering(model, block):
    """(Re-)register the output- and input-centring hooks (a plain nn.Embedding becomes a
    _CenteredEmbedding instead); idempotent."""
    for key, hook, hooks_attr in (
        ("centered_inputs", _center_input_hook, "_forward_pre_hooks"),
        ("centered_outputs", _center_output_hook, "_forward_hooks"),
    ):
        for name in block.get(key, []):
            name = local_name(model, name)
            if name is None:
                continue
            module = model.get_submodule(name)
            if key == "centered_outputs" and type(module) in (nn.Embedding, _CenteredEmbedding):
                # a plain lookup table centres its own output (no hook on the per-token path)
                module.__class__ = _CenteredEmbedding
                continue
            hooks = getattr(module, hooks_attr)
            for hook_id, old in list(hooks.items()):
                if getattr(old, "__name__", "") == hook.__name__:
                    del hooks[hook_id]
                    module._forward_pre_hooks_with_kwargs.pop(hook_id, None)
            if key == "centered_inputs":
                module.register_forward_pre_hook(hook, with_kwargs=True)
            else:
                module.register_forward_hook(hook)


_WARNED_OUTPUTS = set()  # (class, preserved outputs) already warned about: once per process


def warn_unpreserved_outputs(model, block):
    """Warn (once per class and checkpoint kind) when a model converted with ``--exact-outputs pooled``
    returns at top level an output the conversion does not preserve (the raw residual stream, e.g.
    ``last_hidden_state``), naming the outputs that are."""
    shifted = [k for k in block.get("shifted_outputs") or [] if "." not in k]
    exact = block.get("exact_outputs") or []
    key = (type(model).__name__, tuple(exact))
    if not shifted or key in _WARNED_OUTPUTS:
        return
    _WARNED_OUTPUTS.add(key)
    warnings.warn(
        f"{type(model).__name__} was converted with --exact-outputs pooled: {', '.join(shifted)} is not preserved "
        f"(it moves by its per-token mean); the exact outputs are {', '.join(exact)}",
        UserWarning,
        stacklevel=3,
    )


def normswap_classes(model_type, config_name, source_config, sources, weights_variant=None):
    """The converted checkpoint's classes: a config class and, for each ``{class name: source
    model class}``, a subclass that rebuilds the converted tree.

    Returns ``(config class, {class name: model class})``. The checkpoint's modeling file calls
    this with the classes it imports; normswap calls it with the same ones from transformers.

    A checkpoint keeps the source's ``model_type`` (stock AutoConfig and AutoTokenizer read it
    without code or prompts) and stores its weights under the variant name ``weights_variant``
    (model.<variant>.safetensors): a stock class, which would build LayerNorm, finds no weights
    and fails loudly; these classes load and save that variant by default. Checkpoints written
    before the variant had a model type of their own (``normswap_<type>``) and no variant.
    """
    config_cls = type(config_name, (source_config,), {"model_type": model_type, "__module__": __name__})

    def make(name, source):
        def __init__(self, config, *args, **kwargs):
            source.__init__(self, config, *args, **kwargs)
            apply_normswap_structure(self, config.normswap)

        def resize_token_embeddings(self, *args, **kwargs):
            # resizing replaces the embedding module and with it the output-centring hook, and pads a
            # tied head's logits bias with zeros where the new rows' W·β is not zero
            out = source.resize_token_embeddings(self, *args, **kwargs)
            register_runtime_centering(self, self.config.normswap)
            derive_logits_biases(self)
            return out

        def from_pretrained(cls, *args, **kwargs):
            if kwargs.get("variant") is None:
                kwargs["variant"] = weights_variant
            model = source.from_pretrained.__func__(cls, *args, **kwargs)
            loaded = model[0] if isinstance(model, tuple) else model  # output_loading_info=True
            derive_logits_biases(loaded)
            warn_unpreserved_outputs(loaded, loaded.config.normswap)
            return model

        def save_pretrained(self, save_directory, *args, **kwargs):
            if kwargs.get("variant") is None:
                kwargs["variant"] = weights_variant
            out = source.save_pretrained(self, save_directory, *args, **kwargs)
            if type(self)._auto_class is not None and not os.path.isfile(save_directory):
                # loaded as remote code: the saved folder gets this file as transformers gives any
                # remote-code model's (is_remote_code, which would do it, answers False below)
                from transformers.dynamic_module_utils import custom_object_save

                custom_object_save(self, save_directory, config=self.config)
            return out

        def is_remote_code(cls):
            # transformers asks this once per generated token, and for a remote-code class then reads
            # inspect.signature(self.forward) (~120 Python calls) to pass a cache_position argument
            # to a forward that takes one. These classes run the source class's own forward, which
            # transformers calls as it calls the original's: the answer the original gets, False.
            # (The file-copying on save that this answer also switches off is done in save_pretrained.)
            return False

        return type(
            name,
            (source,),
            {
                "config_class": config_cls,
                "__init__": __init__,
                "__module__": __name__,
                "resize_token_embeddings": resize_token_embeddings,
                "from_pretrained": classmethod(from_pretrained),
                "save_pretrained": save_pretrained,
                "is_remote_code": classmethod(is_remote_code),
            },
        )

    for name, source in sources.items():
        _share_key_renaming(name, source)
    return config_cls, {name: make(name, source) for name, source in sources.items()}


def _share_key_renaming(name, source):
    """transformers (5.x) renames checkpoint keys by the loading class's name: CLIPVisionModel drops the
    ``vision_model.`` prefix that a CLIPVisionModelWithProjection checkpoint has. The converted class
    answers to another name (Normswap...), so it is given its source class's renaming, else loading the
    bare tower from the converted projection checkpoint would find none of its weights."""
    try:
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
    except ImportError:  # an older transformers: no renaming by class name
        return
    mapping = get_checkpoint_conversion_mapping(source.__name__)
    if mapping and get_checkpoint_conversion_mapping(name) is None:
        register_checkpoint_conversion_mapping(name, mapping)
