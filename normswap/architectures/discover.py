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
layer has the same structure; describe.py) and is only ever used after
``normswap.architectures.family_check.check_family`` converted a fresh randomised tiny instance (tiny.py)
with it and found the outputs unchanged. The data flow itself is dataflow.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from normswap.architectures.dataflow import DataFlow, layer_stacks
from normswap.architectures.describe import describe
from normswap.architectures.probes import probe_inputs
from normswap.architectures.trace import ADD
from normswap.errors import DiscoveryError, first_line
from normswap.model_facts import is_layernorm

__all__ = ["DiscoveryError", "discover"]


def discover(model, *, name=None, refuse_raw_outputs=True) -> dict:
    """Describe ``model``'s architecture as a family-file dict (raises DiscoveryError with the reason).

    ``refuse_raw_outputs=False`` describes a pre-LN model whose raw stream is a model output anyway
    (no exact plan exists; its other outputs, e.g. a pooled one behind a norm, can still be exact)."""
    model = model.eval()
    g, stacks = trace_norms_and_stacks(model)
    found = StreamFindings(type(model).__name__, g)
    for stack in stacks:
        found.walk_stack(model, stack)
    found.centre_repeated_norm_inputs()
    found.refuse_inexact(refuse_raw_outputs)
    placement = found.settle_placement(stacks)
    return describe(model, stacks, g, found, left_alone(g, found.converted), placement, name)


def trace_norms_and_stacks(model) -> tuple[DataFlow, list[str]]:
    """One traced forward on probe inputs, refused in one line when it finds no LayerNorm or no stack."""
    inputs = probe_inputs(model, seq_len=8)
    try:
        g = DataFlow(model, inputs)
    except DiscoveryError:
        raise
    except Exception as e:
        raise DiscoveryError(f"cannot trace {type(model).__name__} on a probe input: {first_line(e, 200)}") from None
    if not g.norms:
        raise DiscoveryError(
            f"{type(model).__name__}: no module computes LayerNorm (shift-invariant, γ·n+β); nothing to convert"
        )
    stacks = layer_stacks(model, g)
    if not stacks:
        raise DiscoveryError(f"{type(model).__name__}: no stack of layers with LayerNorms found")
    return g, stacks


@dataclass
class StreamFindings:
    """What the walk over each stack's residual stream found: the norms to convert, the writes to
    centre, and the evidence that decides pre- or post-LN and any refusal."""

    model_name: str
    g: DataFlow
    converted: dict[str, dict] = field(default_factory=dict)  # norm -> {"readers": [...], "starts_stream": bool}
    writers: dict[str, str] = field(default_factory=dict)  # module -> kind (linear | table | module)
    stream_biases: list[str] = field(default_factory=list)  # parameters added to the stream as they are
    stream_scales: list[tuple[str, str]] = field(default_factory=list)  # (λ, Linear) for writes λ⊙Linear(x)
    centered_inputs: list[str] = field(default_factory=list)
    post_evidence: list[str] = field(default_factory=list)
    raw_readers: list = field(default_factory=list)  # (stack, consumer) reading the stream outside the layers
    unowned: list[str] = field(default_factory=list)  # writes no module produces (fatal for pre-LN only)
    raw_outputs: list[str] = field(default_factory=list)  # stacks whose raw stream the model returns as it is
    stream_values: dict[int, object] = field(default_factory=dict)
    stream_of: dict[str, str] = field(default_factory=dict)  # norm -> stack
    hidden_sizes: set = field(default_factory=set)

    @property
    def repeated(self) -> set[str]:
        # a norm that runs more than once (BLIP's post_layernorm on the sequence and on the pooled token,
        # ALBERT's shared layer) is one RMSNorm for every call: each call's input must be centred, and
        # its γ/β stay on it (the readers of one call say nothing about the others')
        return {n for n in self.g.norms if self.g.trace.module_calls.get(n, 0) > 1}

    def take_writes(self, parts, consumer, what):
        """Record centring for each write; a bad one falls back to centring ``consumer``'s input."""
        g = self.g
        # a value centred at run time where it is produced (a norm starting the stream, a module's
        # output) is centred for every reader: one that is not the stream (GroupViT's cross-attention
        # query is its group tokens' norm output) would read a shifted value, so centre downstream
        parts = [
            ("bad", f"{mod} (also read outside the stream)", node)
            if kind in ("norm", "module") and g.read_elsewhere(node)
            else (kind, mod, node)
            for kind, mod, node in parts
        ]
        bad = [p for p in parts if p[0] == "bad"]
        if bad:
            if consumer is None:
                # fatal for an exact plan only: a post-LN model (FNet's Fourier mixing, XLNet) needs no
                # writer centred, so the verdict waits until placement is known
                self.unowned.append(
                    f"{self.model_name}: a write into the residual stream ({bad[0][1]} in {what}) "
                    "is not produced by any module"
                )
                return
            if consumer not in self.centered_inputs:
                self.centered_inputs.append(consumer)
            return
        for kind, mod, _node in parts:
            if kind == "norm":
                if mod not in self.converted:
                    self.converted[mod] = {"readers": [], "starts_stream": True}
                    for inp in g.trace.module_call_inputs[mod]:
                        self.take_writes(g.decompose(inp, set()), mod, f"the input of {mod}")
            elif kind == "scaled":
                linear, scale = mod
                self.writers.setdefault(linear, "linear")
                if (scale, linear) not in self.stream_scales:
                    self.stream_scales.append((scale, linear))
            elif kind == "param":
                if mod not in self.stream_biases:
                    self.stream_biases.append(mod)
            else:
                self.writers.setdefault(mod, kind)

    def walk_stack(self, model, stack: str) -> None:
        """Follow one stack's residual stream from its first layer's input: who reads it, who writes it."""
        g = self.g
        layers = model.get_submodule(stack)
        seeds = [g.trace.module_inputs.get(f"{stack}.{i}") for i in range(len(layers))]
        if any(s is None for s in seeds):
            raise DiscoveryError(f"{self.model_name}: layer stack {stack} did not run on the probe input")
        values, readers, foreign = g.stream([seeds[0]])
        self.stream_values.update(values)
        for i, s in enumerate(seeds[1:], 1):
            if id(s) not in values:
                self.post_evidence.append(f"{stack}.{i} input is not the running sum of the previous layer's writes")
        self.hidden_sizes.add(int(seeds[0].tensor.shape[-1]))
        in_layers = [
            c
            for c in foreign
            if any(c.scope == f"{stack}.{i}" or c.scope.startswith(f"{stack}.{i}.") for i in range(len(layers)))
        ]
        for c in in_layers:
            self.post_evidence.append(f"the residual stream is read by {c.scope or c.op} ({c.op}), not only by norms")
        self.raw_readers.extend((stack, f"{c.scope or 'the model'} ({c.op})") for c in foreign if c not in in_layers)
        if any(id(v) in g.output_nodes for v in values.values()):
            self.raw_outputs.append(stack)
        for n in readers:
            self.converted.setdefault(n, {"readers": [], "starts_stream": False})
            self.stream_of[n] = stack
        # writes: the non-stream operands of every addition on the stream
        for node in values.values():
            if node.op in ADD:
                for operand in node.inputs:
                    if id(operand) not in values:
                        self.take_writes(
                            g.decompose(operand, set(values)),
                            None if node is not seeds[0] else f"{stack}.0",
                            f"{stack}",
                        )
        self.take_writes(g.decompose(seeds[0], set()), f"{stack}.0", f"the input of {stack}.0")

    def centre_repeated_norm_inputs(self) -> None:
        for n in sorted(self.repeated & set(self.converted)):
            calls = self.g.trace.module_call_inputs[n]
            if not self.converted[n]["starts_stream"] and any(id(i) not in self.stream_values for i in calls):
                # BLIP's post_layernorm also normalises its own output's first token: that call's input
                # is not centred, so the RMSNorm centres its input at run time (one norm, every call)
                self.centered_inputs.append(n)

    def refuse_inexact(self, refuse_raw_outputs: bool) -> None:
        """A pre-LN model whose exact plan would change an output or a reader: refused, with the reason."""
        if self.post_evidence:
            return
        if self.unowned:
            raise DiscoveryError(self.unowned[0])
        if self.raw_outputs and refuse_raw_outputs:
            # the converted stream is the source stream minus its per-token mean: an output that is the
            # stream itself (VitDet's, SAM3-ViT's last_hidden_state) cannot stay unchanged
            raise DiscoveryError(
                f"{self.model_name}: pre-LN, but the raw residual stream of {self.raw_outputs[0]} is returned as a "
                "model output without a norm; an exact conversion centres the stream, which shifts that output by "
                "its per-token mean, so it is refused"
            )
        if self.raw_readers:
            # pre-LN, but the stream itself (not a norm of it) is read after the last layer: centring the
            # writes would shift what that reader sees by the stream's per-token mean, which the converted
            # model no longer has
            stack, reader = self.raw_readers[0]
            raise DiscoveryError(
                f"{self.model_name}: pre-LN, but the raw residual stream of {stack} is read by {reader} "
                "without a norm; an exact conversion would shift what it reads by the stream's per-token mean, "
                "so it is refused"
            )

    def settle_placement(self, stacks: list[str]) -> str:
        """ "post" (approximate: every norm over the stream becomes an RMSNorm, nothing centred) or "pre"
        (each converted norm's readers, where γ/β fold)."""
        g = self.g
        if not self.post_evidence:
            repeated = self.repeated
            for n, rec in self.converted.items():
                if rec["starts_stream"] or n in repeated:
                    continue
                readers, other = g.readers(n)
                rec["readers"] = readers if readers and not other else []
            return "pre"
        # approximate mode: every norm over the stream width becomes an RMSNorm (γ, β kept)
        self.converted = {
            n: {"readers": [], "starts_stream": False} for n, s in g.norms.items() if s.hidden_size in self.hidden_sizes
        }
        if not self.converted:  # channel-first streams (ConvNeXt, CvT stages): the last axis is not the width
            self.converted = {
                n: {"readers": [], "starts_stream": False}
                for n in g.norms
                if any(n.startswith(s + ".") for s in stacks)
            }
        self.writers, self.centered_inputs, self.stream_biases, self.stream_scales = {}, [], [], []
        return "post"


def left_alone(g: DataFlow, converted: dict) -> dict[str, str]:
    """The norms the plan leaves as they are, each with the reason."""
    left = {
        n: "does not read the residual stream (per-head q/k norm or head transform): its input is not centred"
        for n in g.norms
        if n not in converted
    }
    for n, m in g.modules.items():
        if is_layernorm(m) and n not in g.norms:
            left[n] = f"{type(m).__name__} does not compute LayerNorm (not shift-invariant, or a different formula)"
    return left
