"""ONNX that generates: a decoder graph with a key/value cache, and the loop that runs it.

One graph serves prefill and decode (a prefill is a step whose past has length 0), with the
input and output names optimum's ``ORTModelForCausalLM`` and onnxruntime-genai's decoder read:

    inputs   input_ids [batch, sequence] int64
             attention_mask [batch, past_sequence + sequence] int64
             position_ids [batch, sequence] int64
             past_key_values.N.key / .value [batch, kv_heads, past_sequence, head_dim] float32
    outputs  logits [batch, sequence, vocab]
             present.N.key / .value [batch, kv_heads, past_sequence + sequence, head_dim]

Why one graph and not optimum's two (decoder + decoder-with-past) or its merged If-graph: the
cache is a concatenation, and a concatenation with an empty past is the prefill, so one trace
covers both and the weights are stored once; onnxruntime-genai runs exactly that layout (it feeds
a length-0 past on its first step).

The trace: torch's ONNX exporter (dynamo) on a wrapper that takes the past as flat tensors,
builds transformers' ``DynamicCache`` from them and returns the cache's tensors after the step
(the exporter cannot take a DynamicCache as an input). normswap's converted and sliced models
(remote code) trace the same way; their norms become the same norm ops as in the no-cache export
(onnx.py). ``OnnxGenerator`` is the generate loop on an onnxruntime session (prefill, then one
token a step), the one ``normswap export`` checks greedy parity with and benchmarks time.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from normswap.errors import NormswapError

PAST_KEY, PAST_VALUE = "past_key_values.{}.key", "past_key_values.{}.value"
PRESENT_KEY, PRESENT_VALUE = "present.{}.key", "present.{}.value"
GENAI_CONFIG = "genai_config.json"
GENERATION_FILE = "generation_config.json"


def cache_geometry(config) -> dict:
    """{layers, kv_heads, head_dim} of a decoder's key/value cache, from its config (text config for
    multimodal ones), as transformers' DynamicCache holds it: [batch, kv_heads, length, head_dim]."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None)
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None)
    hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd", None)
    block = getattr(text, "normswap", None) or {}
    hidden = (block.get("slice") or {}).get("hidden_size") or hidden  # a sliced model's attention keeps its width
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (int(hidden) // int(heads) if hidden and heads else None)
    if not (layers and kv_heads and head_dim):
        raise NormswapError(f"cannot read the key/value cache's shape from a {type(config).__name__}")
    return {"layers": int(layers), "kv_heads": int(kv_heads), "head_dim": int(head_dim)}


def generates(model) -> tuple[bool, str]:
    """(True, "") for a model a generation graph can be traced from: a causal LM (transformers says it can
    generate) whose cache is transformers' key/value cache of a readable shape; else (False, why)."""
    can = getattr(model, "can_generate", None)
    if not (callable(can) and can()):
        return False, f"{type(model).__name__} is not a causal language model (it does not generate)"
    try:
        cache_geometry(model.config)
    except NormswapError as e:
        return False, str(e)
    return True, ""


class _WithCache(torch.nn.Module):
    """The model as a function of flat tensors: (input_ids, attention_mask, position_ids, k0, v0, k1, ...)
    -> (logits, present k0, v0, ...)."""

    def __init__(self, model, layers: int):
        super().__init__()
        self.model, self.layers = model, layers

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        present = out.past_key_values
        flat = []
        for i in range(self.layers):
            layer = present.layers[i]
            flat += [layer.keys, layer.values]
        return (out.logits, *flat)


def io_names(layers: int) -> tuple[list[str], list[str]]:
    """(input names, output names) of the generation graph of a ``layers``-layer decoder."""
    past = [name.format(i) for i in range(layers) for name in (PAST_KEY, PAST_VALUE)]
    present = [name.format(i) for i in range(layers) for name in (PRESENT_KEY, PRESENT_VALUE)]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


def export_graph_with_cache(model, path: Path, *, opset: int | None = None, norm_op: str | None = None) -> dict:
    """Trace ``model`` (float32, eval, a causal LM) with its cache into ``path``; returns {op type: count}."""
    import onnx

    from normswap.export import onnx_graph as plain

    opset = opset or plain.OPSET
    norm_op = norm_op or plain.DEFAULT_NORM_OP
    plain.require_packages()
    geo = cache_geometry(model.config)
    layers = geo["layers"]
    wrapper = _WithCache(model, layers).eval()
    batch, seq, past_len = 2, 3, 5  # distinct, > 1: the exporter specialises on sizes 0 and 1
    vocab = int(model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else 0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    mask = torch.ones((batch, past_len + seq), dtype=torch.long)
    pos = torch.arange(past_len, past_len + seq).unsqueeze(0).expand(batch, seq).contiguous()
    kv = (batch, geo["kv_heads"], past_len, geo["head_dim"])
    past = [torch.randn(kv, generator=gen) for _ in range(2 * layers)]
    # Dim.DYNAMIC, not named Dims: the mask's length is past + sequence, a relation the exporter finds itself
    dyn = torch.export.Dim.DYNAMIC
    # (*past: the wrapper's varargs are one tuple to torch.export)
    shapes = ({0: dyn, 1: dyn}, {0: dyn, 1: dyn}, {0: dyn, 1: dyn}, tuple({0: dyn, 2: dyn} for _ in past))
    inputs, outputs = io_names(layers)
    try:
        with plain.exporter_quiet():
            program = torch.onnx.export(
                wrapper,
                (ids, mask, pos, *past),
                dynamo=True,
                opset_version=opset,
                input_names=inputs,
                output_names=outputs,
                dynamic_shapes=shapes,
                verbose=False,
            )
    except Exception as e:  # the exporter's own errors are long; the first line says what it could not trace
        raise NormswapError(
            f"torch.onnx.export could not trace {type(model).__name__} with its key/value cache: "
            f"{str(e).strip().splitlines()[0][:300]}"
        ) from None
    proto = program.model_proto
    _name_dims(proto)
    if norm_op == "simplified":
        plain.use_contrib_norm(proto)
        plain.fuse_residual_adds(proto)
    elif norm_op not in plain.NORM_OPS:
        raise NormswapError(f"unknown ONNX norm op {norm_op!r}; choose one of {', '.join(plain.NORM_OPS)}")
    big = sum(t.ByteSize() for t in proto.graph.initializer) > plain.EXTERNAL_DATA_ABOVE
    onnx.save_model(proto, str(path), save_as_external_data=big, location=path.name + ".data" if big else None)
    from collections import Counter

    return dict(Counter(n.op_type for n in proto.graph.node))


# each input's and output's axes by the names optimum writes (the exporter names them s0, s1 + s2...)
_AXES = {
    "input_ids": ("batch_size", "sequence_length"),
    "position_ids": ("batch_size", "sequence_length"),
    "attention_mask": ("batch_size", "total_sequence_length"),
    "logits": ("batch_size", "sequence_length", None),
    "past_key_values.": ("batch_size", None, "past_sequence_length", None),
    "present.": ("batch_size", None, "total_sequence_length", None),
}


def _name_dims(proto) -> None:
    """The graph's dynamic input and output axes named as optimum names them, for a runtime or a reader
    of the graph's signature (the exporter's own names, s0, s1 + s2..., stay inside the graph)."""
    for v in (*proto.graph.input, *proto.graph.output):
        axes = next(
            (a for key, a in _AXES.items() if v.name == key or (key.endswith(".") and v.name.startswith(key))), ()
        )
        for d, name in zip(v.type.tensor_type.shape.dim, axes):
            if name and d.dim_param:
                d.dim_param = name


def is_generation_ready(onnx_path) -> tuple[bool, str]:
    """(True, "") when the graph at ``onnx_path`` takes and returns a key/value cache by the names this
    module (and optimum, onnxruntime-genai) use, one past/present pair per layer, with dynamic batch and
    lengths; else (False, why in one phrase). Reads the graph's signature only (no weights)."""
    import onnx

    try:
        proto = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as e:  # not a graph at all
        return False, f"{onnx_path} is not an ONNX graph ({str(e).strip().splitlines()[0][:120]})"
    ins = {v.name: v for v in proto.graph.input}
    outs = {v.name: v for v in proto.graph.output}
    if "input_ids" not in ins:
        return False, "the graph has no input_ids input"
    layers = sum(1 for n in ins if n.startswith("past_key_values.") and n.endswith(".key"))
    if layers == 0:
        return False, "the graph takes no past key/values (past_key_values.N.key/value): it recomputes every token"
    if "attention_mask" not in ins:
        return False, "the graph has no attention_mask input"
    if "logits" not in outs:
        return False, "the graph has no logits output"
    for i in range(layers):
        for past, present in ((PAST_KEY, PRESENT_KEY), (PAST_VALUE, PRESENT_VALUE)):
            if past.format(i) not in ins:
                return False, f"the graph has no {past.format(i)} input"
            if present.format(i) not in outs:
                return False, f"the graph has no {present.format(i)} output"
    for name, axes in (("input_ids", (0, 1)), (PAST_KEY.format(0), (0, 2)), (PRESENT_KEY.format(0), (0, 2))):
        v = ins.get(name) or outs.get(name)
        dims = v.type.tensor_type.shape.dim
        if any(axis >= len(dims) or not dims[axis].dim_param for axis in axes):
            return False, f"{name} has a fixed batch or length"
    return True, ""


class OnnxGenerator:
    """Greedy (or sampled) generation on the graph in ``out_dir`` (an onnxruntime CPU session).

    ``prefill(ids)`` runs the prompt and returns the last position's logits; ``decode_step(tokens)``
    feeds one token per row and returns its logits; both keep the cache in ``self.past``. ``generate``
    is the loop over both (no padding: every row of ``input_ids`` is a full prompt)."""

    def __init__(self, out_dir, threads: int | None = 1, model_file: str | None = None, session=None):
        from normswap.export import onnx_graph as plain

        self.dir = Path(out_dir)
        self.path = self.dir / (model_file or plain.MODEL_FILE)
        ready, why = is_generation_ready(self.path)
        if not ready:
            raise NormswapError(f"{self.path} cannot generate: {why} (export it with --with-past)")
        # ``session``: one the caller made of ``self.path`` with its own options (bench serve's timed sessions)
        self.session = session if session is not None else plain.session(self.path, threads=threads)
        names = [i.name for i in self.session.get_inputs()]
        self.layers = sum(1 for n in names if n.startswith("past_key_values.") and n.endswith(".key"))
        first = next(i for i in self.session.get_inputs() if i.name == PAST_KEY.format(0))
        self.kv_heads, self.head_dim = int(first.shape[1]), int(first.shape[3])
        self.has_position_ids = "position_ids" in names
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.past: dict | None = None
        self.length = 0

    def step_feed(self, ids: np.ndarray) -> dict:
        """The inputs of the next step over ``ids`` [batch, sequence] on the cache held (nothing is run:
        bench serve times the same decode step many times at a fixed past length)."""
        if self.past is None:
            raise NormswapError("a step before prefill")
        batch, seq = ids.shape
        feed = {"input_ids": ids, "attention_mask": np.ones((batch, self.length + seq), dtype=np.int64)}
        if self.has_position_ids:
            positions = np.arange(self.length, self.length + seq, dtype=np.int64)
            feed["position_ids"] = np.broadcast_to(positions, (batch, seq)).copy()
        feed.update(self.past)
        return feed

    def _run(self, ids: np.ndarray) -> np.ndarray:
        seq = ids.shape[1]
        out = dict(zip(self.output_names, self.session.run(self.output_names, self.step_feed(ids))))
        self.past = {
            PAST_KEY.format(i) if n.endswith(".key") else PAST_VALUE.format(i): out[n]
            for i in range(self.layers)
            for n in (PRESENT_KEY.format(i), PRESENT_VALUE.format(i))
        }
        self.length += seq
        return out["logits"][:, -1, :]

    def prefill(self, input_ids) -> np.ndarray:
        """Run the prompt [batch, sequence] from an empty cache; the last position's logits [batch, vocab]."""
        ids = np.asarray(input_ids, dtype=np.int64)
        if ids.ndim == 1:
            ids = ids[None, :]
        empty = np.zeros((ids.shape[0], self.kv_heads, 0, self.head_dim), dtype=np.float32)
        self.past = {name.format(i): empty for i in range(self.layers) for name in (PAST_KEY, PAST_VALUE)}
        self.length = 0
        return self._run(ids)

    def decode_step(self, tokens) -> np.ndarray:
        """One new token per row ([batch] or [batch, 1]) on the cache; its logits [batch, vocab]."""
        if self.past is None:
            raise NormswapError("decode_step before prefill")
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)
        return self._run(ids)

    def generate(self, input_ids, max_new_tokens: int, greedy: bool = True, seed: int = 0) -> np.ndarray:
        """[batch, prompt + max_new_tokens] token ids (no early stop at EOS: a fixed number of tokens, as
        transformers' generate with min_new_tokens = max_new_tokens)."""
        ids = np.asarray(input_ids, dtype=np.int64)
        if ids.ndim == 1:
            ids = ids[None, :]
        rng = np.random.default_rng(seed)
        new = []
        logits = self.prefill(ids)
        for step in range(max_new_tokens):
            if greedy:
                token = logits.argmax(-1)
            else:
                p = np.exp(logits - logits.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                token = np.array([rng.choice(p.shape[-1], p=row) for row in p])
            new.append(token.astype(np.int64))
            if step + 1 < max_new_tokens:
                logits = self.decode_step(token)
        return np.concatenate([ids, np.stack(new, 1)], 1) if new else ids


def genai_config(config, geo: dict, generation: dict | None, model_file: str) -> dict:
    """onnxruntime-genai's genai_config.json for the graph: its generic decoder ("type": any decoder-only
    name it knows reads the inputs/outputs by the names given here)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    generation = generation or {}
    eos = generation.get("eos_token_id", getattr(text, "eos_token_id", None))
    bos = generation.get("bos_token_id", getattr(text, "bos_token_id", None))
    pad = generation.get("pad_token_id", getattr(text, "pad_token_id", None))
    eos = eos if eos is not None else 0
    from normswap.model_facts import context_length

    context = int(context_length(config) or 2048)
    return {
        "model": {
            "bos_token_id": bos if bos is not None else eos,
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": model_file,
                "head_size": geo["head_dim"],
                "hidden_size": int(text.hidden_size),
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": PAST_KEY.replace("{}", "%d"),
                    "past_value_names": PAST_VALUE.replace("{}", "%d"),
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": PRESENT_KEY.replace("{}", "%d"),
                    "present_value_names": PRESENT_VALUE.replace("{}", "%d"),
                },
                "num_attention_heads": int(text.num_attention_heads),
                "num_hidden_layers": geo["layers"],
                "num_key_value_heads": geo["kv_heads"],
            },
            "eos_token_id": eos,
            "pad_token_id": pad if pad is not None else (eos if isinstance(eos, int) else eos[0]),
            "type": "llama",
            "vocab_size": int(text.vocab_size),
        },
        "search": {
            "do_sample": False,
            "early_stopping": True,
            "max_length": context,
            "min_length": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": False,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }


def write_genai_config(tmp: Path, model, model_file: str) -> None:
    generation = None
    if (tmp / GENERATION_FILE).is_file():
        generation = json.loads((tmp / GENERATION_FILE).read_text())
    cfg = genai_config(model.config, cache_geometry(model.config), generation, model_file)
    (tmp / GENAI_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")


def prefill_feed(sess, input_ids: np.ndarray) -> dict:
    """The inputs ``sess`` takes for one forward over ``input_ids`` from an empty cache: just the ids for a
    graph without a cache, else an all-ones mask, positions 0.. and length-0 past key/values (how the
    forward of a no-cache graph is reproduced by a generation graph)."""
    ids = np.asarray(input_ids, dtype=np.int64)
    feed = {"input_ids": ids}
    batch, seq = ids.shape
    for i in sess.get_inputs():
        if i.name == "attention_mask":
            feed[i.name] = np.ones((batch, seq), dtype=np.int64)
        elif i.name == "position_ids":
            feed[i.name] = np.broadcast_to(np.arange(seq, dtype=np.int64), (batch, seq)).copy()
        elif i.name.startswith("past_key_values."):
            feed[i.name] = np.zeros((batch, int(i.shape[1]), 0, int(i.shape[3])), dtype=np.float32)
    return feed


def torch_greedy(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """PyTorch's greedy tokens: transformers' generate with the model's own cache, exactly ``new_tokens``
    new ones (no stop at EOS), no padding."""
    pad = getattr(model.generation_config, "pad_token_id", None)
    eos = getattr(model.generation_config, "eos_token_id", None)
    pad = pad if pad is not None else (eos if isinstance(eos, int) else 0)
    with torch.no_grad():
        return model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            num_beams=1,
            pad_token_id=pad,
        )


def check_generation(
    model, out_dir: Path, prompt: torch.Tensor, new_tokens: int, *, tie: float, model_file: str | None = None
) -> dict:
    """Greedy generation through the graph (OnnxGenerator: prefill, then one token a step on the cache)
    against PyTorch's generate on the same prompt rows. Passes when every token is the same, or where the
    first difference is at a tie: PyTorch's two best log-probs there within ``tie`` (both are then the
    greedy choice, to float32 rounding)."""
    ref = torch_greedy(model, prompt, new_tokens).numpy()
    got = OnnxGenerator(out_dir, model_file=model_file).generate(prompt.numpy(), new_tokens)
    start = prompt.shape[1]
    record = {
        "runtime": "onnxruntime (CPU), normswap's generate loop (OnnxGenerator)",
        "prompt_rows": int(prompt.shape[0]),
        "prompt_tokens": int(start),
        "new_tokens": int(new_tokens),
        "identical": bool(np.array_equal(ref, got)),
    }
    if record["identical"]:
        return {**record, "passed": True}
    diff = np.argwhere(ref != got) if ref.shape == got.shape else np.array([[0, start]])
    row, col = (int(x) for x in min(diff, key=lambda rc: rc[1]))
    with torch.no_grad():  # PyTorch's log-probs at the first step where the two chose differently
        logp = model(input_ids=torch.from_numpy(ref[row : row + 1, :col])).logits[0, -1].double().log_softmax(-1)
    top = logp.topk(2).values
    gap = float(top[0] - top[1])
    record.update(first_difference={"row": row, "new_token": col - start, "top2_logprob_gap": gap})
    return {**record, "passed": bool(gap <= tie)}
