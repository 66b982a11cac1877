"""The data flow of one traced forward pass (trace.py), with the questions discovery asks of it:
which modules compute LayerNorm (norms.py, by behaviour), which values are the residual stream,
who writes into it and who reads a norm's output.
"""

from __future__ import annotations

import torch
from torch import nn

from normswap.architectures import norms as norm_probe
from normswap.architectures.trace import ADD, PAD, POOL, REARRANGE, REDUCE, SCALE, TRANSPARENT, trace_forward
from normswap.model_facts import layout_of

# torch functionals whose output is the output of a Linear module's weights (named by this suffix)
FUNCTIONAL_WRITERS = {"linear": ".weight", "multi_head_attention_forward": "out_proj.weight"}


class DataFlow:
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
            return (
                isinstance(t, torch.Tensor)
                and isinstance(src, torch.Tensor)
                and t.dim() > 0
                and src.dim() > 0
                and t.shape[-1] == src.shape[-1]
            )
        t, src = consumer.tensor, node.tensor
        if not rearranged and consumer.op in REARRANGE | PAD | REDUCE | POOL:
            return False
        if consumer.op in REARRANGE:
            return isinstance(t, torch.Tensor) and isinstance(src, torch.Tensor) and t.numel() == src.numel()
        if consumer.op in PAD:
            value = next((v for v in consumer.scalars if isinstance(v, float)), 0.0)
            return (
                isinstance(t, torch.Tensor)
                and isinstance(src, torch.Tensor)
                and value == 0.0
                and len(consumer.inputs) == 1
            )
        if consumer.op in REDUCE:  # over token axes only, never over the features
            dims = [d for d in consumer.scalars if isinstance(d, int)]
            last = {-1, src.dim() - 1} if isinstance(src, torch.Tensor) else set()
            return (
                isinstance(t, torch.Tensor)
                and t.dim() > 0
                and bool(dims)
                and not (set(dims) & last)
                and t.shape[-1] == src.shape[-1]
                and len(consumer.inputs) == 1
            )
        if consumer.op in POOL:  # the channel axis is 1; the exactness check confirms it is the features'
            return (
                isinstance(t, torch.Tensor)
                and isinstance(src, torch.Tensor)
                and t.dim() == src.dim() >= 3
                and t.shape[:2] == src.shape[:2]
                and len(consumer.inputs) == 1
            )
        if consumer.op in SCALE:
            return len(consumer.inputs) == 1 or (
                len(consumer.inputs) == 2
                and consumer.inputs[1].tensor is not None
                and consumer.inputs[1].tensor.dim() == 0
            )
        return False

    def decompose(self, node, stream_ids, depth=0):
        """The writes summed into ``node``: [(kind, module, node)], kind in table/linear/norm/module/bad."""
        if id(node) in stream_ids or depth > 200:
            return []
        if node.modules:
            kind = self.classify(node)
            if kind[0] in ("linear", "table", "norm"):  # a whole module's output (FalconLinear adds its own bias)
                return [kind]
        if (
            node.op in ADD
            and len(node.inputs) == 2
            and all(i.tensor is not None and i.tensor.dim() > 0 for i in node.inputs)
            and node.inputs[0].tensor.shape[-1] == node.inputs[1].tensor.shape[-1] == node.tensor.shape[-1]
        ):
            parts = self.decompose(node.inputs[0], stream_ids, depth + 1) + self.decompose(
                node.inputs[1], stream_ids, depth + 1
            )
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
        scale = next(
            (
                i
                for i in node.inputs
                if i.op == "param" and i.param and i.tensor.dim() == 1 and i.tensor.shape[0] == width
            ),
            None,
        )
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
            if _is_weight_matrix(mod):
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
            if owner is not None and _is_weight_matrix(self.modules.get(owner)):
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
                lin = next(
                    (
                        m
                        for m in (c.scope,)
                        if _is_weight_matrix(self.modules.get(m)) and self.trace.module_inputs.get(m) is not None
                    ),
                    None,
                )
                if (
                    lin
                    and self.trace.module_inputs[lin] in (node, out)
                    or (lin and id(self.trace.module_inputs[lin]) in seen)
                ):
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


def _is_weight_matrix(module) -> bool:
    """A Linear or GPT-2's Conv1D: a module whose weight rows can be centred and columns folded into."""
    return layout_of(module) in ("linear", "conv1d")


def _tensors(value):
    from torch.utils._pytree import tree_leaves

    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def layer_stacks(model, g):
    """The layer stacks: ModuleLists (or Sequentials, CvT) of layers that each hold a LayerNorm-like
    module and run one after the other (layer i reads what layer i-1 returned).

    Hierarchical models (Swin, PVT, CvT) nest one stack per stage inside a list of stages; each
    stage's layers form their own residual stream, so the innermost lists are the stacks. Lists of
    modules that do not feed each other (PVT's per-stage patch embeddings) are not stacks. Models
    that keep their norms in lists of bare norms (XLM's ``layer_norm1``) fall back to those lists.
    """

    def holds_norms(name, module, bare):
        return all(
            any(n.startswith(f"{name}.{i}.") or (bare and n == f"{name}.{i}") for n in g.norms)
            for i in range(len(module))
        )

    def chained(name, module):
        return all(g.fed_by(g.trace.module_inputs.get(f"{name}.{i}"), f"{name}.{i - 1}") for i in range(1, len(module)))

    for bare in (False, True):
        lists = [
            name
            for name, module in model.named_modules()
            if isinstance(module, (nn.ModuleList, nn.Sequential))
            and len(module) > 0
            and holds_norms(name, module, bare)
            and (bare or chained(name, module))
        ]
        stacks = [name for name in lists if not any(other.startswith(name + ".") for other in lists)]
        if stacks:
            return stacks
    return []
