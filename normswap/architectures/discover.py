"""Discover a family description from the model itself, and check it by an exact conversion.

On a tiny float64 instance of the architecture, one traced forward pass (trace.py) gives the data
flow. From it:

* LayerNorm-like modules are found by behaviour (norms.py), whatever their class is called.
* The *residual stream* of each layer stack is the set of values reachable from a layer's input
  through additions, per-token-transparent ops (dropout, casts, views keeping the last axis) and
  scalar scaling. A norm reading a stream value is a stream norm; the other operands of the
  additions are the *writes*, traced back to the module that produced them: a Linear/Conv1D (its
  weight rows are centred), an embedding table (its rows are centred), a norm (its output is
  re-centred at run time, like BLOOM's embedding LayerNorm), or any other module returning a tensor
  (its output is centred at run time). A write no module produces alone (ViT's class token,
  Whisper's conv features) falls back to centring the stack's first layer input at run time.
* Post-LN: the stream is read by something other than a norm or an addition (BERT's attention
  reads the previous norm's output): approximate mode only.
* A norm's *readers* are the Linear/Conv1D modules its output feeds (through transparent ops); γ
  and β fold into them only when nothing else reads it and it is not a model output.
* Norms not reading the stream (per-head q/k norms, head transforms) are left alone.

The description is written in the family-file schema (paths templated over ``${i}`` when every
layer has the same structure) and is only ever used after :func:`check_family` converted a fresh
randomised tiny instance with it and found the outputs unchanged.
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from normswap.architectures import norms as norm_probe
from normswap.architectures.probes import model_outputs, probe_inputs
from normswap.architectures.schema import Family, parse_family
from normswap.architectures.trace import ADD, PAD, POOL, REARRANGE, REDUCE, SCALE, TRANSPARENT, trace_forward
from normswap.errors import NormswapError, first_line
from normswap.model_facts import declared_eps, is_layernorm, output_embeddings

EXACT_RTOL = 1e-5  # relative to the output scale; float32-internal norms (Cohere, OLMo) stay ~1e-7


# torch functionals whose output is the output of a Linear module's weights (named by this suffix)
FUNCTIONAL_WRITERS = {"linear": ".weight", "multi_head_attention_forward": "out_proj.weight"}


class DiscoveryError(NormswapError):
    """Discovery could not describe the architecture (the message says why)."""


# -- tiny instances -----------------------------------------------------------------------------

_SIZES = {
    # config attribute -> tiny value (applied to the config and every sub-config that has it)
    "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "embed_dim": 64, "dim": 64,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "intermediate_size": 128, "ffn_dim": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "n_inner": 128,
    "hidden_dim": 128, "projection_dim": 32, "projection_size": 64, "head_dim": 16, "kv_channels": 16, "rotary_dim": 8,
    "image_size": 32, "patch_size": 8, "max_source_positions": 32, "max_target_positions": 64,
    "max_position_embeddings": 128, "n_positions": 128, "vocab_size": 256,
}


def shrink_config(config):
    """A copy of ``config`` with tiny sizes, so a float64 instance costs milliseconds."""
    config = copy.deepcopy(config)

    def visit(cfg, depth=0):
        if depth > 2:
            return
        for attr, value in _SIZES.items():
            have = getattr(cfg, attr, None)
            if isinstance(have, int) and not isinstance(have, bool) and have > value:
                try:
                    setattr(cfg, attr, value)
                except Exception:
                    pass
        for attr in ("num_heads", "num_attention_heads"):
            heads = getattr(cfg, attr, None)
            if isinstance(heads, (list, tuple)) and heads and all(isinstance(h, int) and h > 0 for h in heads):
                # per-stage heads (Swin's 3, 6, 12, 24) must divide the shrunk widths: powers of two do
                setattr(cfg, attr, [1 << (h.bit_length() - 1) for h in heads])
        kv = getattr(cfg, "num_key_value_heads", None)
        if isinstance(kv, int) and kv > 1:
            cfg.num_key_value_heads = 2
        elif "num_key_value_heads" in vars(cfg) and kv is None and isinstance(getattr(cfg, "num_attention_heads", None), int):
            cfg.num_key_value_heads = cfg.num_attention_heads  # None means "as many as query heads"
        vocab = getattr(cfg, "vocab_size", None)
        for attr in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id"):
            v = getattr(cfg, attr, None)
            if isinstance(vocab, int) and isinstance(v, int) and v >= vocab:
                setattr(cfg, attr, vocab - 1)
        for attr in ("layer_types",):
            v = getattr(cfg, attr, None)
            n = getattr(cfg, "num_hidden_layers", None)
            if isinstance(v, list) and isinstance(n, int):
                setattr(cfg, attr, v[:n])
        for name in list(vars(cfg)):
            sub = getattr(cfg, name, None)
            if hasattr(sub, "to_dict") and sub is not cfg and hasattr(sub, "model_type"):
                visit(sub, depth + 1)

    visit(config)
    return config


def model_class(config):
    from normswap.checkpoint.load import model_class_for

    return model_class_for(config)


def tiny_instance(config, cls=None, *, seed=0, shrink=True, dtype=torch.float64):
    """A randomised float64 (or ``dtype``) model of ``config``'s architecture (γ far from 1, β and biases non-zero)."""
    from normswap.architectures.randomize import randomize_

    cfg = shrink_config(config) if shrink else copy.deepcopy(config)
    cls = cls or model_class(cfg)
    torch.manual_seed(seed)
    try:
        model = cls.from_config(cfg) if hasattr(cls, "from_config") else cls._from_config(cfg)
    except Exception as e:
        raise DiscoveryError(f"cannot build a tiny {getattr(cfg, 'model_type', '?')} model: {first_line(e, 200)}") from None
    model = model.to(dtype).eval()
    randomize_(model, seed)
    return model



# -- discovery ----------------------------------------------------------------------------------


class _Graph:
    """The trace of one model, with the questions discovery asks of it."""

    def __init__(self, model, inputs):
        self.model = model
        self.modules = dict(model.named_modules())
        self.trace, self.outputs = trace_forward(model, inputs)
        self.norms: dict[str, norm_probe.NormSpec] = {}
        for name, module in self.modules.items():
            node = self.trace.module_inputs.get(name)
            if node is None or not isinstance(node.tensor, torch.Tensor) or node.tensor.dim() < 1:
                continue
            spec = norm_probe.layernorm_spec(module, tuple(node.tensor.shape))
            if spec is not None:
                self.norms[name] = spec
        self.output_nodes = {id(self.trace.node(t)) for t in _tensors(self.outputs)}

    def in_scope(self, node, module_name):
        return node.scope == module_name or node.scope.startswith(module_name + ".")

    def reads(self, norm, node) -> bool:
        """Whether one of ``norm``'s calls took ``node`` as its input."""
        return any(i is node for i in self.trace.module_call_inputs.get(norm, ()))

    def fed_by(self, node, module, depth=8) -> bool:
        """Whether ``node`` is ``module``'s output, possibly moved around by per-token ops (a layer's input
        that the previous layer returned)."""
        while node is not None and depth >= 0:
            if module in node.modules:
                return True
            if node.op not in TRANSPARENT | REARRANGE | PAD or not node.inputs:
                return False
            node, depth = node.inputs[0], depth - 1
        return False

    def norm_output(self, name):
        outs = self.trace.module_outputs.get(name) or []
        return outs[0] if outs else None

    def passes_on(self, node, consumer, rearranged=True) -> bool:
        """Whether ``consumer`` carries ``node``'s value on per token (still centred if it was).

        ``rearranged=False`` leaves out ops that move the feature axis or mix tokens: a write traced back
        through them would be centred at run time along an axis that was not its feature axis then.
        """
        if consumer.op in TRANSPARENT:
            t, src = consumer.tensor, node.tensor
            return isinstance(t, torch.Tensor) and isinstance(src, torch.Tensor) and t.dim() > 0 and src.dim() > 0 and t.shape[-1] == src.shape[-1]
        t, src = consumer.tensor, node.tensor
        if not rearranged and consumer.op in REARRANGE | PAD | REDUCE | POOL:
            return False
        if consumer.op in REARRANGE:
            return isinstance(t, torch.Tensor) and isinstance(src, torch.Tensor) and t.numel() == src.numel()
        if consumer.op in PAD:
            value = next((v for v in consumer.scalars if isinstance(v, float)), 0.0)
            return isinstance(t, torch.Tensor) and isinstance(src, torch.Tensor) and value == 0.0 and len(consumer.inputs) == 1
        if consumer.op in REDUCE:  # over token axes only, never over the features
            dims = [d for d in consumer.scalars if isinstance(d, int)]
            last = {-1, src.dim() - 1} if isinstance(src, torch.Tensor) else set()
            return isinstance(t, torch.Tensor) and t.dim() > 0 and bool(dims) and not (set(dims) & last) \
                and t.shape[-1] == src.shape[-1] and len(consumer.inputs) == 1
        if consumer.op in POOL:  # the channel axis is 1; the exactness check confirms it is the features'
            return isinstance(t, torch.Tensor) and isinstance(src, torch.Tensor) and t.dim() == src.dim() >= 3 \
                and t.shape[:2] == src.shape[:2] and len(consumer.inputs) == 1
        if consumer.op in SCALE:
            return len(consumer.inputs) == 1 or (len(consumer.inputs) == 2 and consumer.inputs[1].tensor is not None and consumer.inputs[1].tensor.dim() == 0)
        return False

    def decompose(self, node, stream_ids, depth=0):
        """The writes summed into ``node``: [(kind, module, node)], kind in table/linear/norm/module/bad."""
        if id(node) in stream_ids or depth > 200:
            return []
        if node.modules:
            kind = self.classify(node)
            if kind[0] in ("linear", "table", "norm"):  # a whole module's output (FalconLinear adds its own bias)
                return [kind]
        if node.op in ADD and len(node.inputs) == 2 and all(i.tensor is not None and i.tensor.dim() > 0 for i in node.inputs) \
                and node.inputs[0].tensor.shape[-1] == node.inputs[1].tensor.shape[-1] == node.tensor.shape[-1]:
            parts = self.decompose(node.inputs[0], stream_ids, depth + 1) + self.decompose(node.inputs[1], stream_ids, depth + 1)
        elif node.inputs and self.passes_on(node.inputs[0], node, rearranged=False):
            parts = self.decompose(node.inputs[0], stream_ids, depth + 1)
        elif node.inputs and self.passes_on(node.inputs[0], node) and keeps_feature_axis(node.inputs[0], node):
            # moved around (SAM's window un-partition): fine for centred weights, whose output is
            # centred along the writer's own feature axis as long as that axis stays last (GroupViT's
            # token-mixing MLP is transposed back: its output axis is the tokens); not for a run-time
            # centring of a module
            parts = self.decompose(node.inputs[0], stream_ids, depth + 1)
            if any(kind not in ("linear", "table") for kind, *_ in parts):
                parts = [("bad", node.op, node)]
        elif (scaled := self.layer_scaled(node, stream_ids, depth)) is not None:
            parts = [scaled]
        else:
            parts = [self.classify(node)]
        if any(kind == "bad" for kind, *_ in parts):
            # a module that returns this very value can have its output centred at run time
            for m in reversed(node.modules):  # the outermost (ViTEmbeddings, not its dropout)
                if self.trace.module_returns_tensor.get(m) and m not in self.norms:
                    return [("module", m, node)]
        return parts

    def layer_scaled(self, node, stream_ids, depth):
        """("scaled", (linear, λ), node) for a write λ⊙(Linear output) with λ a parameter vector over the
        features (InternVL's lambda_1): λ folds into the Linear's rows, which are then centred."""
        if node.op not in SCALE or node.op.startswith(("div", "__truediv", "__itruediv")) or len(node.inputs) != 2:
            return None
        width = node.tensor.shape[-1] if isinstance(node.tensor, torch.Tensor) and node.tensor.dim() > 0 else None
        scale = next((i for i in node.inputs if i.op == "param" and i.param and i.tensor.dim() == 1 and i.tensor.shape[0] == width), None)
        if scale is None:
            return None
        other = node.inputs[1] if node.inputs[0] is scale else node.inputs[0]
        parts = self.decompose(other, stream_ids, depth + 1)
        if len(parts) != 1 or parts[0][0] != "linear" or not isinstance(self.modules[parts[0][1]], nn.Linear):
            return None
        return ("scaled", (parts[0][1], scale.param), node)

    def classify(self, node):
        if node.modules:
            m = node.modules[0]
            mod = self.modules[m]
            if m in self.norms:
                return ("norm", m, node)
            if isinstance(mod, nn.Embedding) and isinstance(getattr(mod, "weight", None), nn.Parameter):
                return ("table", m, node)
            if _is_linear(mod):
                return ("linear", m, node)
        if node.op == "embedding" or node.op == "param":
            pname = node.param if node.op == "param" else next((i.param for i in node.inputs if i.param), None)
            owner = pname.rpartition(".")[0] if pname else None
            if owner is not None and isinstance(self.modules.get(owner), nn.Embedding) and pname.endswith("weight"):
                return ("table", owner, node)
        suffix = FUNCTIONAL_WRITERS.get(node.op)
        if suffix is not None:  # a functional call on a Linear's own weight (nn.MultiheadAttention's out_proj)
            pname = next((i.param for i in node.inputs if i.param and i.param.endswith(suffix)), None)
            owner = pname[: -len(".weight")] if pname else None
            if owner is not None and _is_linear(self.modules.get(owner)):
                return ("linear", owner, node)
        if node.op == "param" and node.param and node.tensor.dim() == 1:
            # a bias vector added to the stream as it is (GPT-NeoX-Japanese's attention returns its
            # dense_bias beside the output): centring the vector keeps the write zero-mean
            return ("param", node.param, node)
        if node.modules and self.trace.module_returns_tensor.get(node.modules[0]):
            return ("module", node.modules[0], node)
        return ("bad", _what(node), node)

    def read_elsewhere(self, node) -> bool:
        """Whether anything but an addition or a norm reads ``node`` (following per-token ops)."""
        todo, seen = [node], set()
        while todo:
            n = todo.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            for c in n.consumers:
                if c.op in ADD or any(self.in_scope(c, m) and self.reads(m, n) for m in self.norms):
                    continue
                if self.passes_on(n, c, rearranged=False):
                    todo.append(c)
                else:
                    return True
        return False

    def stream(self, seeds):
        """Values reachable from ``seeds`` through additions and transparent ops; and their non-norm readers."""
        seen: dict[int, object] = {}
        foreign: list = []
        norm_readers: set[str] = set()
        todo = list(seeds)
        while todo:
            node = todo.pop()
            if id(node) in seen:
                continue
            seen[id(node)] = node
            for c in node.consumers:
                norm = next((n for n in self.norms if self.in_scope(c, n) and self.reads(n, node)), None)
                if norm is not None:
                    norm_readers.add(norm)
                elif c.op in ADD or self.passes_on(node, c):
                    todo.append(c)
                else:
                    foreign.append(c)
        return seen, norm_readers, foreign

    def readers(self, norm):
        """Linear modules reading the norm's output, and whether anything else reads it."""
        out = self.norm_output(norm)
        readers, other, todo, seen = [], [], [out], set()
        while todo:
            node = todo.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if id(node) in self.output_nodes:
                other.append("a model output")
            for c in node.consumers:
                if self.in_scope(c, norm):
                    continue
                lin = next((m for m in (c.scope,) if _is_linear(self.modules.get(m)) and self.trace.module_inputs.get(m) is not None), None)
                if lin and self.trace.module_inputs[lin] in (node, out) or (lin and id(self.trace.module_inputs[lin]) in seen):
                    if lin not in readers:
                        readers.append(lin)
                elif self.passes_on(node, c) and keeps_feature_axis(node, c):
                    todo.append(c)
                else:
                    other.append(c.scope or c.op)
        return readers, other


def _what(node) -> str:
    """An unowned write, named for a refusal: its op and the parameters it reads directly."""
    params = [i.param for i in node.inputs if i.param]
    return f"{node.op} by parameter {', '.join(params)}" if params else node.op


def keeps_feature_axis(src, consumer) -> bool:
    """Whether ``consumer`` leaves ``src``'s last (feature) axis last: a Linear after it still reads
    the features (γ folds into its columns), not the tokens (GroupViT's token-mixing MLP reads the
    norm's output transposed)."""
    t, x = consumer.tensor, src.tensor
    if not (isinstance(t, torch.Tensor) and isinstance(x, torch.Tensor) and t.dim() > 0 and x.dim() > 0):
        return False
    if t.shape[-1] != x.shape[-1]:
        return False
    if consumer.op not in REARRANGE:
        return True
    last = {-1, x.dim() - 1}
    dims = [d for d in consumer.scalars if isinstance(d, int)]
    if consumer.op == "permute":
        return bool(dims) and dims[-1] in last
    if consumer.op in ("transpose", "swapaxes", "movedim"):
        return len(dims) >= 2 and not (set(dims[:2]) & last)
    if consumer.op == "flatten":  # flatten(start=0, end=-1) merges the feature axis unless it stops earlier
        return len(dims) >= 2 and dims[1] not in last
    if consumer.op == "unflatten":
        return bool(dims) and dims[0] not in last
    return consumer.op in ("squeeze", "unsqueeze")


def _is_linear(module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _tensors(value):
    from torch.utils._pytree import tree_leaves

    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _layer_stacks(model, g):
    """The layer stacks: ModuleLists (or Sequentials, CvT) of layers that each hold a LayerNorm-like
    module and run one after the other (layer i reads what layer i-1 returned).

    Hierarchical models (Swin, PVT, CvT) nest one stack per stage inside a list of stages; each
    stage's layers form their own residual stream, so the innermost lists are the stacks. Lists of
    modules that do not feed each other (PVT's per-stage patch embeddings) are not stacks. Models
    that keep their norms in lists of bare norms (XLM's ``layer_norm1``) fall back to those lists.
    """
    def holds_norms(name, module, bare):
        return all(any(n.startswith(f"{name}.{i}.") or (bare and n == f"{name}.{i}") for n in g.norms)
                   for i in range(len(module)))

    def chained(name, module):
        return all(g.fed_by(g.trace.module_inputs.get(f"{name}.{i}"), f"{name}.{i - 1}") for i in range(1, len(module)))

    for bare in (False, True):
        lists = [name for name, module in model.named_modules()
                 if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 0 and holds_norms(name, module, bare)
                 and (bare or chained(name, module))]
        stacks = [name for name in lists if not any(other.startswith(name + ".") for other in lists)]
        if stacks:
            return stacks
    return []


def discover(model, *, name=None, refuse_raw_outputs=True) -> dict:
    """Describe ``model``'s architecture as a family-file dict (raises DiscoveryError with the reason).

    ``refuse_raw_outputs=False`` describes a pre-LN model whose raw stream is a model output anyway
    (no exact plan exists; its other outputs, e.g. a pooled one behind a norm, can still be exact)."""
    model = model.eval()
    inputs = probe_inputs(model, seq_len=8)
    try:
        g = _Graph(model, inputs)
    except DiscoveryError:
        raise
    except Exception as e:
        raise DiscoveryError(f"cannot trace {type(model).__name__} on a probe input: {first_line(e, 200)}") from None
    if not g.norms:
        raise DiscoveryError(f"{type(model).__name__}: no module computes LayerNorm (shift-invariant, γ·n+β); nothing to convert")
    stacks = _layer_stacks(model, g)
    if not stacks:
        raise DiscoveryError(f"{type(model).__name__}: no stack of layers with LayerNorms found")
    # a norm that runs more than once (BLIP's post_layernorm on the sequence and on the pooled token,
    # ALBERT's shared layer) is one RMSNorm for every call: each call's input must be centred, and
    # its γ/β stay on it (the readers of one call say nothing about the others')
    repeated = {n for n in g.norms if g.trace.module_calls.get(n, 0) > 1}

    converted: dict[str, dict] = {}  # norm -> {"readers": [...], "starts_stream": bool}
    writers: dict[str, str] = {}  # module -> kind (linear | table | module)
    stream_biases: list[str] = []  # parameters added to the stream as they are
    stream_scales: list[tuple[str, str]] = []  # (λ parameter, Linear) for writes λ⊙Linear(x)
    centered_inputs: list[str] = []
    post_evidence: list[str] = []
    raw_readers: list = []  # (stack, consumer) reading the stream outside the layers
    unowned: list[str] = []  # writes into the stream that no module produces (fatal for pre-LN only)
    raw_outputs: list[str] = []  # stacks whose raw stream the model returns as it is
    stream_values: dict[int, object] = {}
    stream_of: dict[str, str] = {}  # norm -> stack
    hidden_sizes = set()

    def take_writes(parts, consumer, what):
        """Record centring for each write; a bad one falls back to centring ``consumer``'s input."""
        # a value centred at run time where it is produced (a norm starting the stream, a module's
        # output) is centred for every reader: one that is not the stream (GroupViT's cross-attention
        # query is its group tokens' norm output) would read a shifted value, so centre downstream
        parts = [("bad", f"{mod} (also read outside the stream)", node) if kind in ("norm", "module") and g.read_elsewhere(node) else (kind, mod, node)
                 for kind, mod, node in parts]
        bad = [p for p in parts if p[0] == "bad"]
        if bad:
            if consumer is None:
                # fatal for an exact plan only: a post-LN model (FNet's Fourier mixing, XLNet) needs no
                # writer centred, so the verdict waits until placement is known
                unowned.append(f"{type(model).__name__}: a write into the residual stream ({bad[0][1]} in {what}) is not produced by any module")
                return
            if consumer not in centered_inputs:
                centered_inputs.append(consumer)
            return
        for kind, mod, node in parts:
            if kind == "norm":
                if mod not in converted:
                    converted[mod] = {"readers": [], "starts_stream": True}
                    for inp in g.trace.module_call_inputs[mod]:
                        take_writes(g.decompose(inp, set()), mod, f"the input of {mod}")
            elif kind == "scaled":
                linear, scale = mod
                writers.setdefault(linear, "linear")
                if (scale, linear) not in stream_scales:
                    stream_scales.append((scale, linear))
            elif kind == "param":
                if mod not in stream_biases:
                    stream_biases.append(mod)
            else:
                writers.setdefault(mod, kind)

    for stack in stacks:
        layers = model.get_submodule(stack)
        seeds = [g.trace.module_inputs.get(f"{stack}.{i}") for i in range(len(layers))]
        if any(s is None for s in seeds):
            raise DiscoveryError(f"{type(model).__name__}: layer stack {stack} did not run on the probe input")
        values, readers, foreign = g.stream([seeds[0]])
        stream_values.update(values)
        for i, s in enumerate(seeds[1:], 1):
            if id(s) not in values:
                post_evidence.append(f"{stack}.{i} input is not the running sum of the previous layer's writes")
        hidden_sizes.add(int(seeds[0].tensor.shape[-1]))
        in_layers = [c for c in foreign if any(c.scope == f"{stack}.{i}" or c.scope.startswith(f"{stack}.{i}.") for i in range(len(layers)))]
        for c in in_layers:
            post_evidence.append(f"the residual stream is read by {c.scope or c.op} ({c.op}), not only by norms")
        raw_readers.extend((stack, f"{c.scope or 'the model'} ({c.op})") for c in foreign if c not in in_layers)
        if any(id(v) in g.output_nodes for v in values.values()):
            raw_outputs.append(stack)
        for n in readers:
            converted.setdefault(n, {"readers": [], "starts_stream": False})
            stream_of[n] = stack
        # writes: the non-stream operands of every addition on the stream
        for node in values.values():
            if node.op in ADD:
                for operand in node.inputs:
                    if id(operand) not in values:
                        take_writes(g.decompose(operand, set(values)), None if node is not seeds[0] else f"{stack}.0", f"{stack}")
        start = g.decompose(seeds[0], set())
        take_writes(start, f"{stack}.0", f"the input of {stack}.0")

    for n in sorted(repeated & set(converted)):
        if not converted[n]["starts_stream"] and any(id(i) not in stream_values for i in g.trace.module_call_inputs[n]):
            # BLIP's post_layernorm also normalises its own output's first token: that call's input
            # is not centred, so the RMSNorm centres its input at run time (one norm, every call)
            centered_inputs.append(n)
    if unowned and not post_evidence:
        raise DiscoveryError(unowned[0])
    if raw_outputs and not post_evidence and refuse_raw_outputs:
        # the converted stream is the source stream minus its per-token mean: an output that is the
        # stream itself (VitDet's, SAM3-ViT's last_hidden_state) cannot stay unchanged
        raise DiscoveryError(
            f"{type(model).__name__}: pre-LN, but the raw residual stream of {raw_outputs[0]} is returned as a model output "
            "without a norm; an exact conversion centres the stream, which shifts that output by its per-token mean, so it is refused")
    if raw_readers and not post_evidence:
        # pre-LN, but the stream itself (not a norm of it) is read after the last layer: centring the
        # writes would shift what that reader sees by the stream's per-token mean, which the converted
        # model no longer has
        stack, reader = raw_readers[0]
        raise DiscoveryError(
            f"{type(model).__name__}: pre-LN, but the raw residual stream of {stack} is read by {reader} "
            "without a norm; an exact conversion would shift what it reads by the stream's per-token mean, so it is refused")
    placement = "post" if post_evidence else "pre"
    if placement == "post":
        # approximate mode: every norm over the stream width becomes an RMSNorm (γ, β kept)
        converted = {n: {"readers": [], "starts_stream": False} for n, s in g.norms.items() if s.hidden_size in hidden_sizes}
        if not converted:  # channel-first streams (ConvNeXt, CvT stages): the last axis is not the width
            converted = {n: {"readers": [], "starts_stream": False} for n in g.norms if any(n.startswith(s + ".") for s in stacks)}
        writers, centered_inputs, stream_biases, stream_scales = {}, [], [], []
    else:
        for n, rec in converted.items():
            if rec["starts_stream"] or n in repeated:
                continue
            readers, other = g.readers(n)
            rec["readers"] = readers if readers and not other else []
    left = {n: "does not read the residual stream (per-head q/k norm or head transform): its input is not centred"
            for n in g.norms if n not in converted}
    for n, m in g.modules.items():
        if is_layernorm(m) and n not in g.norms:
            left[n] = f"{type(m).__name__} does not compute LayerNorm (not shift-invariant, or a different formula)"
    return _describe(model, stacks, g, converted, writers, centered_inputs, left, placement, post_evidence, name,
                     stream_biases, stream_scales)


def _describe(model, stacks, g, converted, writers, centered_inputs, left, placement, post_evidence, name,
              stream_biases=(), stream_scales=()) -> dict:
    """Write the findings in the family-file schema, templating per-layer paths over ``${i}``."""
    config = model.config
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = prefix + "." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""

    def rel(path):
        return path[len(base):] if base and path.startswith(base) else ("^" + path if base else path)

    main = stacks[0]
    main_len = len(model.get_submodule(main))
    pattern = re.compile(re.escape(rel(main)) + r"\.(\d+)\.")

    def template(path):
        m = pattern.match(path)
        return (pattern.sub(f"{rel(main)}.${{i}}.", path, count=1), int(m.group(1))) if m else (path, None)

    def collapse(items):
        """items: [(path, payload)], payload hashable: one templated entry when all layers agree."""
        groups: dict = {}
        order = []
        for path, payload in items:
            t, idx = template(path)
            key = (t, (tuple(template(p)[0] for p in payload[0]), payload[1]))
            if key not in groups:
                order.append(key)
                groups[key] = set()
            groups[key].add(idx)
        out = []
        for key in order:
            idxs = groups[key]
            if None not in idxs and idxs == set(range(main_len)):
                out.append(key)
            else:  # not uniform across layers: spell out each one
                for path, payload in items:
                    t, _ = template(path)
                    if (t, (tuple(template(p)[0] for p in payload[0]), payload[1])) == key:
                        out.append((path, (tuple(payload[0]), payload[1])))
        return out

    def spec_extras(n):
        s = g.norms[n]
        extra = {}
        if s.gamma_offset:
            extra["gamma_offset"] = s.gamma_offset
        declared = declared_eps(g.modules[n])
        if declared is None or abs(declared - s.eps) > 1e-3 * s.eps:
            extra["eps"] = s.eps
        return extra

    final = None
    stack_output_norms = []
    layer_items, other_items = [], []
    for n in sorted(converted, key=lambda n: list(g.modules).index(n)):
        rec = converted[n]
        payload = (tuple(rel(r) for r in rec["readers"]), rec["starts_stream"])
        in_layers = any(n.startswith(s + ".") for s in stacks)
        (layer_items if in_layers else other_items).append((rel(n), payload, n))
        if not in_layers and not rec["starts_stream"]:
            stack_output_norms.append(n)

    def norm_entry(path, payload, source):
        e = {"norm": path, "readers": list(payload[0])}
        if payload[1]:
            e["starts_stream"] = True
        e.update(spec_extras(source))
        return e

    norms_out = []
    sources = {rel(n): n for n in converted}
    for path, payload in collapse([(p, pl) for p, pl, _ in layer_items]):
        src = sources.get(path) or sources[path.replace("${i}", "0")]
        norms_out.append(norm_entry(path, payload, src))
    for path, payload, src in other_items:
        entry = norm_entry(path, payload, src)
        if final is None and src in stack_output_norms and src == stack_output_norms[-1] and placement == "pre":
            final = entry
        else:
            norms_out.append(entry)
    if not norms_out and final is not None:
        norms_out, final = [final], None

    embeddings = [rel(m) for m, kind in writers.items() if kind in ("table",) or (kind == "module" and not any(m.startswith(s + ".") for s in stacks))]
    writer_paths = [rel(m) for m, kind in writers.items() if rel(m) not in embeddings]
    writer_out = []
    for path, _ in collapse([(w, ((), False)) for w in writer_paths]):
        writer_out.append(path)
    head = output_embeddings(model)
    head_name = next((n for n, m in g.modules.items() if m is head), None) if head is not None else None

    leave = [{"pattern": re.escape(n), "reason": reason} for n, reason in left.items()]
    raw = {
        "name": name or getattr(config, "model_type", type(model).__name__).replace("-", "_"),
        "display": f"{type(model).__name__} (discovered)",
        "model_types": [getattr(config, "model_type", "unknown")],
        "placement": placement,
        "layers": rel(main),
        "embeddings": embeddings,
        "writers": writer_out,
        "norms": norms_out,
        "final_norm": final,
        "head": rel(head_name) if head_name else None,
        "leave_alone": leave,
        "centered_inputs": [rel(c) for c in centered_inputs],
        "stream_biases": [path for path, _ in collapse([(rel(p), ((), False)) for p in stream_biases])],
        "stream_scales": [{"scale": path, "writer": payload[0][0]}
                          for path, payload in collapse([(rel(p), ((rel(w),), False)) for p, w in stream_scales])],
        "notes": ("post-LN: " + "; ".join(dict.fromkeys(post_evidence))[:300]) if post_evidence else "",
        "discovered": True,
    }
    if raw["final_norm"] is None:
        raw.pop("final_norm")
    for key in ("stream_biases", "stream_scales"):
        if not raw[key]:
            raw.pop(key)
    return raw


# -- the check every discovered description must pass ---------------------------------------------


def check_family(family: Family, config, cls=None, *, seed=1, dtype=torch.float64) -> dict:
    """Convert a fresh randomised tiny instance with ``family``; compare every output in float64.

    Returns {"exact": bool|None, "max_abs_diff", "threshold", "mode", "reason"}; ``exact`` is None
    for post-LN families (approximate only by construction).
    """
    from normswap.convert.inplace import check_convertible, convert_with_family
    from normswap.convert.plan import ConvertOptions

    source = tiny_instance(config, cls, seed=seed, dtype=dtype)
    placement = family.placement_for(source.config)
    if placement == "post":
        # approximate by nature; still, the approximate plan must convert the tiny instance and run
        failure = _approx_failure(family, source, seed)
        if failure:
            return {"exact": False, "mode": "approx", "max_abs_diff": None, "threshold": None,
                    "reason": f"post-LN, and the approximate conversion {failure}"}
        return {"exact": None, "mode": "approx", "max_abs_diff": None, "threshold": None,
                "reason": "not pre-LN (a norm's output is the residual skip path, or the stream is read by more than norms)"}
    converted = copy.deepcopy(source)
    try:
        check_convertible(converted, converted.config)
        convert_with_family(converted, family, ConvertOptions(mode="exact"))
    except NormswapError as e:
        return {"exact": False, "mode": "exact", "max_abs_diff": None, "threshold": None, "reason": str(e)}
    except Exception as e:  # a fold whose shapes do not fit (a reader that reads another axis): not this plan
        return {"exact": False, "mode": "exact", "max_abs_diff": None, "threshold": None,
                "reason": f"the plan does not apply to the tiny model: {first_line(e, 200)}"}
    inputs = probe_inputs(source, seq_len=8, seed=seed)
    try:
        ref = model_outputs(source, inputs)
        got = model_outputs(converted, inputs)
    except Exception as e:
        return {"exact": False, "mode": "exact", "max_abs_diff": None, "threshold": None,
                "reason": f"the converted tiny model does not run: {first_line(e, 200)}"}
    scale = max([1.0] + [float(r.double().abs().max()) for r in ref.values()])
    threshold = EXACT_RTOL * scale
    worst, changed, shifted = 0.0, [], []
    for key, r in ref.items():
        if key not in got or got[key].shape != r.shape:
            return {"exact": False, "mode": "exact", "max_abs_diff": None, "threshold": None,
                    "reason": f"converted model's output {key} differs in shape"}
        delta = got[key].double() - r.double()
        diff = float(delta.abs().max())
        worst = max(worst, diff)
        if diff > threshold:
            changed.append(key)
            if any(float((delta - delta.mean(ax, keepdim=True)).abs().max()) <= threshold
                   for ax in range(1, delta.dim()) if delta.shape[ax] > 1):
                shifted.append(key)
    exact = not changed
    reason = ""
    if changed and shifted == changed:
        reason = (f"output {', '.join(changed)} is the raw residual stream (no norm before it leaves the model); "
                  "an exact conversion centres the stream, which shifts it per token")
    elif changed:
        reason = f"output {', '.join(changed[:3])} changed by {worst:.3g} (> {threshold:.3g}) on a tiny randomised instance"
    return {"exact": exact, "mode": "exact", "max_abs_diff": worst, "threshold": threshold, "reason": reason,
            "changed_outputs": changed}


def _approx_failure(family, source, seed) -> str:
    """Why an approximate conversion of ``source`` with ``family`` fails ('' when it converts, runs and
    returns every output, finite wherever the source's is). Shapes may differ: lengths some models
    predict from their hidden states (VITS's, FastSpeech2's durations) move with an approximation."""
    from normswap.convert.inplace import convert_with_family
    from normswap.convert.plan import ConvertOptions

    converted = copy.deepcopy(source)
    try:
        convert_with_family(converted, family, ConvertOptions(mode="approx"))
        inputs = probe_inputs(source, seq_len=8, seed=seed)
        ref, got = model_outputs(source, inputs), model_outputs(converted, inputs)
    except Exception as e:
        return f"fails: {first_line(e, 200)}"
    missing = [k for k in ref if k not in got]
    if missing:
        return f"does not return output {', '.join(missing[:3])}"
    broken = [k for k, r in ref.items() if got[k].shape == r.shape and bool((torch.isfinite(r) & ~torch.isfinite(got[k])).any())]
    return f"makes output {', '.join(broken[:3])} non-finite" if broken else ""


def discover_family(config, cls=None, *, name=None) -> tuple[Family, dict]:
    """Discover on a tiny instance of ``config``, check, and return (family, check result)."""
    dtype = torch.float64
    model = tiny_instance(config, cls, seed=0)
    try:
        raw = discover(model, name=name)
    except DiscoveryError as e:
        if "cannot trace" not in str(e):
            raise
        # some modeling code does not run in float64 (XGLM's masking): float32 is enough to see the flow
        dtype = torch.float32
        model = tiny_instance(config, cls, seed=0, dtype=dtype)
        raw = discover(model, name=name)
    family = parse_family(raw, f"discovered from {type(model).__name__}")
    check = check_family(family, config, cls, dtype=dtype)
    if check["exact"] is False and any(n.get("readers") for n in raw["norms"] + ([raw["final_norm"]] if raw.get("final_norm") else [])):
        # folding γ/β is an optimisation; keeping them on the RMSNorm is exact whenever centring is
        unfolded = copy.deepcopy(raw)
        for n in unfolded["norms"] + ([unfolded["final_norm"]] if unfolded.get("final_norm") else []):
            n["readers"] = []
        fam2 = parse_family(unfolded, family.source)
        check2 = check_family(fam2, config, cls, dtype=dtype)
        if check2["exact"]:
            check2["note"] = "γ/β folding was not exact, so they stay on the RMSNorm: " + check["reason"]
            raw, family, check = unfolded, fam2, check2
    return family, {**check, "description": raw}


_RESOLVED: dict = {}


def resolve_family(config, cls=None, family_file=None) -> Family:
    """The family for ``config``: ``family_file`` when given, else its curated data file, else one
    discovered from the model.

    A family file or a discovered description is used only when converting a fresh randomised tiny
    instance with it left every output unchanged (post-LN ones, approximate by nature, are used in
    approx mode); otherwise refuse with the reason.
    """
    from normswap.architectures.registry import family_for_config, has_family, load_family_file, supported_summary

    if family_file is None and has_family(config):
        return family_for_config(config)
    key = (config.to_json_string(use_diff=False), getattr(cls, "__name__", None), str(family_file))
    if key not in _RESOLVED:
        if family_file is not None:
            _RESOLVED[key] = _checked_file_family(load_family_file(family_file), config, cls)
            return _RESOLVED[key]
        known = f"; supported families: {supported_summary()}"
        try:
            family, check = discover_family(config, cls)
        except DiscoveryError as e:
            raise NormswapError(f"unsupported architecture: model_type={config.model_type!r} has no family file, and discovery failed: {e}{known}") from None
        if check["exact"] is False:  # None: post-LN, whose approximate plan converted and ran
            raise NormswapError(
                f"unsupported architecture: model_type={config.model_type!r} has no family file, and the discovered plan "
                f"is not exact on a tiny randomised instance ({check['reason']}){known}")
        _RESOLVED[key] = family
    return _RESOLVED[key]


def _checked_file_family(family: Family, config, cls) -> Family:
    """``family`` (from --family-file) if it describes ``config``'s model_type and passes the exactness check."""
    model_type = getattr(config, "model_type", None)
    if model_type not in family.model_types:
        raise NormswapError(f"family file {family.source} describes model_types {', '.join(family.model_types)}, not {model_type!r}")
    try:
        check = check_family(family, config, cls)
    except DiscoveryError as e:
        raise NormswapError(f"family file {family.source}: {e}") from None
    except NormswapError:
        raise
    except Exception as e:  # a path the model does not have, a module of the wrong kind
        raise NormswapError(f"family file {family.source} does not fit {model_type}: {first_line(e, 200)}") from None
    if check["exact"] is False:
        raise NormswapError(f"family file {family.source} is not exact on a tiny randomised {model_type} instance ({check['reason']})")
    return family
