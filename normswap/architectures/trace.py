"""A data-flow trace of one forward pass, at the level discovery needs.

Every torch function call made while the model runs becomes a node (its op name and the nodes of
its tensor inputs); module hooks mark which module produced each node and which node each module
read. In-place ops (``x += y``) rebind the tensor to a new node, so the trace stays a DAG of
values rather than of tensor objects. Tensors are kept alive for the trace's lifetime so that
``id()`` is never reused: the model is tiny.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

# ops that pass a value on unchanged per token (as far as "is it centred along the last axis" goes)
TRANSPARENT = {
    "dropout",
    "feature_alpha_dropout",
    "alpha_dropout",
    "view",
    "reshape",
    "contiguous",
    "to",
    "float",
    "double",
    "half",
    "bfloat16",
    "type",
    "type_as",
    "clone",
    "detach",
    "__get__",
    "__getitem__",
    "data",
    "expand",
    "expand_as",
    "broadcast_to",  # a bias vector broadcast over the tokens keeps its last axis
}
# ops whose later tensor arguments give only a shape or dtype (``bias.expand_as(residual)``): those are
# not a use of the value, or GPT-NeoX-Japanese's stream would look read by something other than norms
SHAPE_DONORS = {"expand_as", "view_as", "reshape_as", "type_as"}
# ops that move a value's axes around without mixing its numbers (window partitions, channel-first
# layouts between layers): a centred feature vector stays a centred feature vector, wherever its
# axis went. Discovery follows the stream through them; the exactness check confirms the axis.
REARRANGE = {"permute", "transpose", "movedim", "swapaxes", "flatten", "unflatten", "squeeze", "unsqueeze", "T", "mT"}
# zero padding adds all-zero positions (centred) and leaves the others alone
PAD = {"pad"}
# averages over tokens (mean pooling): an average of centred feature vectors is centred
REDUCE = {"mean", "sum"}
# averages over the positions of a channel-first layout (N, C, ...): channels never mix, so an
# average of centred feature vectors is centred (Qwen2-Audio's encoder halves its frames this way)
POOL = {"avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d"}
ADD = {"add", "__add__", "__radd__", "__iadd__", "add_"}
SCALE = {"mul", "__mul__", "__rmul__", "__imul__", "mul_", "div", "__truediv__", "__itruediv__", "div_"}


# ops that read only shape, dtype or device: not a use of the value
METADATA = {
    "__get__",
    "__set__",
    "size",
    "dim",
    "numel",
    "__len__",
    "is_floating_point",
    "is_contiguous",
    "data_ptr",
    "element_size",
    "stride",
    "new_ones",
    "new_zeros",
    "new_empty",
    "new_full",
    "new_tensor",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "get_device",
    "is_complex",
    "__format__",
    "__repr__",
    "__bool__",
}


class Node:
    __slots__ = ("op", "inputs", "scalars", "modules", "consumers", "tensor", "param", "scope")

    def __init__(self, op, inputs=(), scalars=(), tensor=None, param=None, scope=""):
        self.scope = scope  # the innermost module running when the op ran
        self.op = op
        self.inputs = list(inputs)
        self.scalars = list(scalars)
        self.modules: list[str] = []  # modules that returned this value, innermost first
        self.consumers: list[Node] = []
        self.tensor = tensor
        self.param = param

    def __repr__(self):
        return f"Node({self.op}, modules={self.modules})"


class Trace(TorchFunctionMode):
    """Run ``model(**inputs)`` under this mode (see :func:`trace_forward`)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.nodes: dict[int, Node] = {}
        self.keep: list = []
        self.param_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        self.module_inputs: dict[str, Node] = {}  # module name -> node of its first tensor input (first call)
        self.module_call_inputs: dict[str, list[Node]] = {}  # module name -> that node for every call
        self.module_outputs: dict[str, list[Node]] = {}
        self.module_returns_tensor: dict[str, bool] = {}
        self.module_calls: dict[str, int] = {}
        self.stack: list[str] = []

    def node(self, t: torch.Tensor) -> Node:
        n = self.nodes.get(id(t))
        if n is None:
            pid = id(t)
            n = Node("param" if pid in self.param_names else "input", tensor=t, param=self.param_names.get(pid))
            self.nodes[id(t)] = n
            self.keep.append(t)
        return n

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if name == "__get__" and isinstance(out, torch.Tensor):
            # a tensor-valued attribute (``.real`` of an FFT, ``.T``, ``.data``) is a value, named by
            # the attribute: left out, its result would look like an input nobody produced
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name in METADATA:
            return out
        flat = tree_leaves((args, kwargs))
        ins = [self.node(a) for a in flat if isinstance(a, torch.Tensor)]
        if name in SHAPE_DONORS:
            ins = ins[:1]
        scalars = [a for a in flat if isinstance(a, (int, float)) and not isinstance(a, bool)]
        mutated = (
            name.endswith("_")
            and not name.startswith("__")
            or name in ("__iadd__", "__imul__", "__itruediv__", "__setitem__")
        )
        results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if name == "__setitem__" and args and isinstance(args[0], torch.Tensor):
            results = [args[0]]
        if mutated and args and isinstance(args[0], torch.Tensor) and not any(r is args[0] for r in results):
            results.append(args[0])
        if not mutated:
            # ``x.to(float32)`` on a float32 x returns x itself: the value did not change, and a new node
            # would make every earlier use of x (a residual kept aside) look like a use of the cast
            results = [t for t in results if not any(t is a for a in flat if isinstance(a, torch.Tensor))]
        for t in results:
            n = Node(name, ins, scalars, tensor=t, scope=self.stack[-1] if self.stack else "")
            for i in ins:
                i.consumers.append(n)
            self.nodes[id(t)] = n
            self.keep.append(t)
        return out

    def install_hooks(self):
        handles = []
        for mname, module in self.model.named_modules():

            def pre(mod, args, kwargs, mname=mname):
                first = next(
                    (a for a in tree_leaves((args, kwargs.get("hidden_states"))) if isinstance(a, torch.Tensor)), None
                )
                if first is not None:
                    self.module_inputs.setdefault(mname, self.node(first))
                    self.module_call_inputs.setdefault(mname, []).append(self.node(first))
                self.module_calls[mname] = self.module_calls.get(mname, 0) + 1
                self.stack.append(mname)

            def post(mod, args, output, mname=mname):
                if self.stack and self.stack[-1] == mname:
                    self.stack.pop()
                self.module_returns_tensor.setdefault(mname, isinstance(output, torch.Tensor))
                for t in tree_leaves(output):
                    if isinstance(t, torch.Tensor):
                        n = self.node(t)
                        n.modules.append(mname)
                        self.module_outputs.setdefault(mname, []).append(n)

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post))
        return handles


def trace_forward(model: nn.Module, inputs: dict):
    """Run the model once under the trace; returns (trace, outputs)."""
    trace = Trace(model)
    handles = trace.install_hooks()
    try:
        with torch.no_grad(), trace:
            out = model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return trace, out
