"""int8 for an ONNX graph: onnxruntime's own dynamic quantizer, not a hand-written one.

``quantize_graph(fp32, out)`` runs ``onnxruntime.quantization.quantize_dynamic`` with weights int8
per output channel (``per_channel=True``, QInt8) and activations quantized at run time (uint8, one
scale a tensor, computed per call by DynamicQuantizeLinear). Only ``MatMul`` and ``Gemm`` nodes are
handed to it: its other rule, the opset-23 ``Attention`` node to ``QAttention``, writes a node
onnxruntime 1.23 refuses (``is_causal`` is not a QAttention attribute), and the attention scores
multiply two activations, which dynamic int8 does not reach anyway.

One graph edit of ours before it: a tied head reads the embedding table through a ``Transpose``
node, so the head's MatMul has no initializer for the quantizer to see and would stay float32 (in
GPT-2 small that head is 38.6 M of the 124 M weights and a third of a decoded token's matmul
work). The transposed table is written as an initializer of its own (``untie_transposed_weights``);
the lookup keeps the float32 table, the head gets the int8 copy: vocab × hidden bytes more on disk
than a tied graph would hold at int8, the price of quantizing the head at all.

What cannot carry int8 is refused in one line before anything is written (``check_scheme``), and a
graph in which the quantizer reached no MatMul or Gemm is refused after it ran (nothing to gain,
and the directory would claim int8 it does not hold).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

from normswap.errors import NormswapError

SCHEMES = ("int8",)
QUANTIZABLE = ("MatMul", "Gemm")
QUANTIZED = ("MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QGemm")
LIBRARY = "onnxruntime.quantization.quantize_dynamic (per_channel=True, weight_type=QInt8, MatMul/Gemm)"


def check_scheme(scheme: str | None, fmt: str) -> str | None:
    """``scheme`` when ``fmt`` can carry it; one line otherwise (before anything is read or written)."""
    if scheme is None:
        return None
    if scheme not in SCHEMES:
        raise NormswapError(f"--quantize {scheme!r} is not a scheme normswap knows; choose one of {', '.join(SCHEMES)}")
    if fmt != "onnx":
        raise NormswapError(
            f"--quantize {scheme} needs --format onnx (the {fmt} format is a float checkpoint; int8 is written by "
            "onnxruntime's quantizer into an ONNX graph); nothing was written"
        )
    return scheme


def untie_transposed_weights(proto) -> int:
    """Give every MatMul whose weight is ``Transpose(initializer)`` that weight as an initializer of its
    own (the tied head); returns how many. The Transpose stays only where something else reads it."""
    import numpy as np
    from onnx import helper, numpy_helper

    graph = proto.graph
    inits = {i.name: i for i in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    count = 0
    for node in graph.node:
        if node.op_type != "MatMul" or len(node.input) != 2 or node.input[1] in inits:
            continue
        tr = producer.get(node.input[1])
        if tr is None or tr.op_type != "Transpose" or tr.input[0] not in inits:
            continue
        perm = next((list(helper.get_attribute_value(a)) for a in tr.attribute if a.name == "perm"), None)
        table = numpy_helper.to_array(inits[tr.input[0]])
        if table.ndim != 2 or perm not in (None, [1, 0]):
            continue
        name = tr.input[0] + ".transposed_for_int8"
        if name not in inits:
            inits[name] = numpy_helper.from_array(np.ascontiguousarray(table.T), name)
            graph.initializer.append(inits[name])
        node.input[1] = name
        count += 1
    readers = Counter(name for node in graph.node for name in node.input)
    kept = [n for n in graph.node if not (n.op_type == "Transpose" and not any(readers[o] for o in n.output))]
    del graph.node[:]
    graph.node.extend(kept)
    return count


class _QuietAdvice(logging.Filter):
    """The quantizer logs, on the root logger, advice to run its pre-processing first (shape inference
    and graph optimisation, which onnxruntime's session does anyway when it loads the graph): kept
    from the user's stderr; its warnings about the graph itself still pass."""

    def filter(self, record):
        return "pre-processing before quantization" not in record.getMessage()


def _not_matrices(proto) -> list[str]:
    """Names of the MatMul nodes whose constant weight is not a matrix (a sliced tied head's k-vector
    adapter_u): per-channel int8 of a vector gives a zero-point shape onnxruntime's kernel refuses at
    run time ("b zero point is not valid"), and such a product is k multiply-adds a token anyway."""
    inits = {i.name: len(i.dims) for i in proto.graph.initializer}
    return [n.name for n in proto.graph.node if n.op_type == "MatMul" and inits.get(n.input[1], 2) != 2]


def quantize_graph(fp32_path, out_path) -> dict:
    """int8 of the float32 graph at ``fp32_path`` written to ``out_path``; returns what was quantized."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    fp32_path, out_path = Path(fp32_path), Path(out_path)
    proto = onnx.load(str(fp32_path))
    before = Counter(n.op_type for n in proto.graph.node)
    untied = untie_transposed_weights(proto)
    skipped = _not_matrices(proto)
    prepared = out_path.with_name(out_path.name + ".prepared.onnx")
    onnx.save_model(proto, str(prepared))
    del proto
    quiet = _QuietAdvice()
    logging.getLogger().addFilter(quiet)
    try:
        quantize_dynamic(
            str(prepared),
            str(out_path),
            per_channel=True,
            weight_type=QuantType.QInt8,
            op_types_to_quantize=list(QUANTIZABLE),
            nodes_to_exclude=skipped,
        )
    except Exception as e:  # the quantizer's own errors are long: the first line says what it refused
        raise NormswapError(f"onnxruntime's quantizer failed: {str(e).strip().splitlines()[0][:300]}") from None
    finally:
        logging.getLogger().removeFilter(quiet)
        prepared.unlink(missing_ok=True)
    after = Counter(n.op_type for n in onnx.load(str(out_path), load_external_data=False).graph.node)
    quantized = sum(after[op] for op in QUANTIZED)
    left = sum(after[op] for op in QUANTIZABLE)
    if quantized == 0:
        out_path.unlink(missing_ok=True)
        raise NormswapError(
            f"--quantize int8 reached no MatMul or Gemm in this graph ({sum(before[op] for op in QUANTIZABLE)} "
            "float matmuls, none with a constant weight the quantizer can take); nothing was written"
        )
    return {
        "scheme": "int8",
        "library": LIBRARY,
        "weights": "int8, one scale per output channel",
        "activations": "uint8, quantized at run time (one scale a tensor per call)",
        "matmuls_quantized": quantized,
        "float_matmuls_left": left,
        "head_untied_for_int8": untied,
        "bytes": out_path.stat().st_size,
        "float32_bytes": fp32_path.stat().st_size,
    }


def agreement(reference, candidate) -> dict:
    """{max_abs_logprob_diff, top1_agreement}: two logits tensors [batch, seq, vocab] (float32 vs int8)."""
    ref, got = reference.double().log_softmax(-1), candidate.double().log_softmax(-1)
    return {
        "max_abs_logprob_diff": float((ref - got).abs().max()),
        "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).double().mean()),
    }
