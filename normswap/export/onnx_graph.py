"""The ONNX graph itself: torch's exporter made quiet, onnxruntime's contrib norm ops written in, the
residual Adds folded into them, sessions opened one way, and the constants every ONNX path shares.
export/onnx.py (the forward graph and `export --format onnx`) and export/onnx_generate.py (the graph
with a key/value cache) both build on this module, so neither imports the other's internals.
"""

from __future__ import annotations

import contextlib
import io
from collections import Counter
from pathlib import Path

import torch

from normswap.checkpoint.manifest import read_manifest
from normswap.errors import NormswapError
from normswap.export.norm_ops import DEFAULT_ONNX_NORM_OP, ONNX_NORM_OPS

OPSET = 23
MODEL_FILE = "model.onnx"
NORM_OPS, DEFAULT_NORM_OP = ONNX_NORM_OPS, DEFAULT_ONNX_NORM_OP
# a norm that has absorbed the residual Add before it: what each norm op becomes (onnxruntime contrib ops)
SKIP_OPS = {"SimplifiedLayerNormalization": "SkipSimplifiedLayerNormalization"}
MS_DOMAIN = "com.microsoft"
EXTERNAL_DATA_ABOVE = int(1.5e9)  # protobuf's 2 GB limit, with room for the graph
# onnxruntime's graph optimisation level of every session normswap opens (session())
OPTIMIZATION_LEVEL = "ORT_ENABLE_ALL"
# the norm ops a graph may hold before and after onnxruntime's fusions (Skip*: the residual add fused in)
NORM_OP_TYPES = (
    "LayerNormalization",
    "SkipLayerNormalization",
    "RMSNormalization",
    "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization",
)


def require_packages() -> None:
    """onnx, onnxruntime and onnxscript (torch's exporter needs it), or one line saying how to install them."""
    import importlib.util

    missing = [name for name in ("onnx", "onnxruntime", "onnxscript") if importlib.util.find_spec(name) is None]
    if missing:
        raise NormswapError(f"--format onnx needs the package(s) {', '.join(missing)}: pip install 'normswap[onnx]'")


def is_onnx_dir(path) -> bool:
    """A directory ``normswap export --format onnx`` wrote."""
    path = Path(path)
    if not (path / MODEL_FILE).is_file():
        return False
    record = (read_manifest(path) or {}).get("export") or {}
    return record.get("format") == "onnx"


class FirstOutput(torch.nn.Module):
    """The model as a function of ``input_ids`` alone, returning its first output."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        ids = torch.zeros((1, 2), dtype=torch.long)
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=False)
        self.name = "logits" if getattr(out, "logits", None) is not None else next(iter(out.keys()), "output")

    def forward(self, input_ids):
        out = self.model(input_ids=input_ids, use_cache=False)
        return out.logits if self.name == "logits" else out[0]


@contextlib.contextmanager
def exporter_quiet():
    """The exporter's chatter kept from the user: its progress goes to stdout (which --json owns),
    its registry logs a warning per torchvision op it skips when torchvision is not installed (ops
    no language model uses), and the tracer raises Python warnings about internals. Its errors
    still surface: they are exceptions."""
    import logging
    import warnings

    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def export_graph(model, path: Path, *, opset: int = OPSET, norm_op: str = DEFAULT_NORM_OP) -> dict:
    """Trace ``model`` (float32, eval) into ``path``; returns {op type: count} of the graph."""
    require_packages()
    import onnx

    wrapper = FirstOutput(model).eval()
    ids = torch.randint(0, int(model.config.vocab_size), (2, 8), generator=torch.Generator().manual_seed(0))
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
    try:
        with exporter_quiet():
            program = torch.onnx.export(
                wrapper,
                (ids,),
                dynamo=True,
                opset_version=opset,
                input_names=["input_ids"],
                output_names=[wrapper.name],
                dynamic_shapes=({0: batch, 1: seq},),
                verbose=False,
            )
    except Exception as e:  # the exporter's own errors are long; the first line says what it could not trace
        raise NormswapError(
            f"torch.onnx.export could not trace {type(model).__name__}: {str(e).strip().splitlines()[0]}"
        ) from None
    proto = program.model_proto
    if norm_op == "simplified":
        use_contrib_norm(proto)
        fuse_residual_adds(proto)
    elif norm_op not in NORM_OPS:
        raise NormswapError(f"unknown ONNX norm op {norm_op!r}; choose one of {', '.join(NORM_OPS)}")
    big = sum(t.ByteSize() for t in proto.graph.initializer) > EXTERNAL_DATA_ABOVE
    onnx.save_model(proto, str(path), save_as_external_data=big, location=path.name + ".data" if big else None)
    return dict(Counter(n.op_type for n in proto.graph.node))


def use_contrib_norm(proto) -> int:
    """Rewrite every RMSNormalization node (opset 23) as onnxruntime's contrib SimplifiedLayerNormalization
    (same inputs X, scale; same axis and epsilon); returns how many were rewritten."""
    from onnx import helper

    count = 0
    for node in proto.graph.node:
        if node.op_type != "RMSNormalization":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        del node.attribute[:]
        node.op_type, node.domain = "SimplifiedLayerNormalization", ""
        node.attribute.extend(
            [
                helper.make_attribute("axis", int(attrs.get("axis", -1))),
                helper.make_attribute("epsilon", float(attrs.get("epsilon", 1e-5))),
                helper.make_attribute("stash_type", 1),
            ]
        )
        del node.output[1:]
        count += 1
    if count and not any(o.domain == "" for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("", OPSET))
    return count


def _shapes(graph) -> dict:
    """{value name: [dim (int or symbolic name)]} from the graph's inputs, outputs and value_info."""
    out = {}
    for v in (*graph.input, *graph.output, *graph.value_info):
        t = v.type.tensor_type
        if t.HasField("shape"):
            out[v.name] = [d.dim_param or (d.dim_value if d.HasField("dim_value") else None) for d in t.shape.dim]
    return out


def _skip_operands(add, shapes) -> tuple[str, str] | None:
    """(input, skip) of a residual Add that SkipSimplifiedLayerNormalization can absorb, else None:
    two activations of the same shape (or the skip one row shared by the batch, [1, sequence,
    hidden], as a position embedding is), known from the exporter's shapes, never guessed."""
    a, b = (shapes.get(name) for name in add.input)
    if not a or not b or len(a) != 3 or len(b) != 3 or None in a or None in b:
        return None
    if a == b or (b[0] == 1 and a[1:] == b[1:]):
        return add.input[0], add.input[1]
    if a[0] == 1 and a[1:] == b[1:]:
        return add.input[1], add.input[0]
    return None


def fuse_residual_adds(proto) -> int:
    """Fold each residual Add that feeds a SimplifiedLayerNormalization into it, as onnxruntime's
    SkipSimplifiedLayerNormalization (output = norm(input + skip) * scale; its fourth output is the
    sum itself, wired to the Add's other consumers so the residual stream goes on unchanged).
    Returns how many norms absorbed their Add. The export's validation checks the result against
    PyTorch like any other graph."""
    from onnx import helper

    graph = proto.graph
    shapes = _shapes(graph)
    producer = {out: node for node in graph.node for out in node.output}
    consumers = Counter(name for node in graph.node for name in node.input)
    outputs = {o.name for o in graph.output}
    fused, drop = 0, set()
    for node in graph.node:
        add = producer.get(node.input[0]) if node.op_type in SKIP_OPS and node.domain == "" else None
        if add is None or add.op_type != "Add" or add.domain != "" or id(add) in drop:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        operands = _skip_operands(add, shapes)
        if operands is None or attrs.get("axis", -1) not in (-1, 2):  # the Skip op normalises the last axis only
            continue
        total = add.output[0]
        # the sum is still needed by others (the next residual Add) or is a graph output: keep it as output 3
        keep_sum = consumers[total] > 1 or total in outputs
        node.op_type, node.domain = SKIP_OPS[node.op_type], MS_DOMAIN
        node.input[:] = [*operands, node.input[1]]
        del node.attribute[:]
        node.attribute.append(helper.make_attribute("epsilon", float(attrs.get("epsilon", 1e-5))))
        node.output[:] = [node.output[0], "", "", total] if keep_sum else [node.output[0]]
        drop.add(id(add))
        fused += 1
    if fused:
        kept = [n for n in graph.node if id(n) not in drop]
        del graph.node[:]
        graph.node.extend(kept)
        if not any(o.domain == MS_DOMAIN for o in proto.opset_import):
            proto.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return fused


def read_export(directory) -> bytes | Path:
    """The graph of the export in ``directory``, read by the rule for every directory normswap reads
    back (private_dirs): the directory must be this user's, nothing on the way to it replaceable by
    another user, and ``model.onnx`` (and its weights file, if any) a regular file in it that is
    not a link and that nobody else can write. A graph another user can write could compute
    anything while `bench onnx` reports it as the user's own export. Returns the graph's bytes,
    read through the checked handle (so a file swapped after the check is not the one read), or,
    for a graph with external weights, its checked path (onnxruntime reads those weights by name).
    Raises NotPrivate (one line: which path, why)."""
    import os

    from normswap.private_dirs import NotPrivate, open_private_dir, open_private_file

    directory = Path(directory)
    try:
        dir_fd = open_private_dir(directory)
    except FileNotFoundError:
        raise NotPrivate(f"{directory} does not exist") from None
    try:
        names = [MODEL_FILE] + ([MODEL_FILE + ".data"] if os.path.lexists(directory / (MODEL_FILE + ".data")) else [])
        fds = []
        try:
            for name in names:
                try:
                    fds.append(open_private_file(dir_fd, name, where=directory))
                except FileNotFoundError:
                    raise NormswapError(
                        f"{directory} holds no {name}: not a directory `normswap export --format onnx` wrote"
                    ) from None
            if len(fds) > 1:
                return directory / MODEL_FILE
            with os.fdopen(os.dup(fds[0]), "rb") as f:
                return f.read()
        finally:
            for fd in fds:
                os.close(fd)
    finally:
        os.close(dir_fd)


def session(path, threads: int | None = None, optimized_path=None):
    """An onnxruntime CPU session of ``path`` (a graph file, or a graph's bytes from read_export; all
    graph optimisations; ``threads`` intra-op threads; ``optimized_path``: also write the optimised
    graph there)."""
    require_packages()
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPTIMIZATION_LEVEL)
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = int(threads)
        opts.inter_op_num_threads = 1
    if optimized_path is not None:
        opts.optimized_model_filepath = str(optimized_path)
        # the weights beside the graph, so a large model's optimised copy stays under protobuf's 2 GB
        opts.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", Path(optimized_path).name + ".data"
        )
    model = path if isinstance(path, bytes) else str(path)
    return ort.InferenceSession(model, sess_options=opts, providers=["CPUExecutionProvider"])


def optimised_norm_ops(graph, scratch, name: str = "graph") -> dict:
    """{norm op type: count} in the graph onnxruntime actually runs for ``graph`` (a path or bytes;
    after its graph optimisations at OPTIMIZATION_LEVEL, e.g. LayerNormalization + Add fused into
    SkipLayerNormalization): the optimised graph is written into the directory ``scratch`` as
    ``name``-optimised.onnx and read back. Detected, not assumed: which fusions fire depends on the
    onnxruntime version."""
    import onnx

    out = Path(scratch) / f"{name}-optimised.onnx"
    session(graph, threads=1, optimized_path=out)
    ops = Counter(n.op_type for n in onnx.load(str(out), load_external_data=False).graph.node)
    return {op: ops[op] for op in NORM_OP_TYPES if ops[op]}
