"""Rotate and slice: the sliced model's config block and tensors, and the model built from them.

Row-vector convention (normswap/shared algebra: a writer adds h·W_out + b_out to the stream, a
reader computes y·W_in from a norm's output y). With Q_k the first k columns of the basis
(basis.py, u last so never kept when k < d):

- every tensor that writes the stream (embedding tables, writers' weights and biases, the
  stream's bias vectors) is contracted with Q_k along the axis the stream runs in it: E·Q_k,
  W_out·Q_k, b_out·Q_k (a Linear's [out, in] weight along axis 0, a Conv1D's [in, out] along 1);
- every reader's weight along its input axis, times c = sqrt(d/k): a norm over k coordinates with
  ε' = ε·d/k equals the norm over d up to exactly that uniform gain (its records here say so);
- layer scales held at ones stay ones, k wide;
- a tied head whose final norm kept γ gets the adapter (R, g, m, b) of remote_code._SlicedTiedHead;
  one whose final norm has no γ takes c as the norm's weight.

The sliced model is built the way loading the written checkpoint builds it (the source class,
then remote_code.apply_normswap_structure with the sliced block), so what is verified in memory
is the structure users load. Arithmetic is float64, cast once to the model's dtype.
"""

from __future__ import annotations

import copy
import math

import torch

from normswap.checkpoint.remote_code import apply_normswap_structure
from normswap.errors import NormswapError
from normswap.slice.stream import StreamMap


def contract(tensor: torch.Tensor, axis: int, q: torch.Tensor) -> torch.Tensor:
    """``tensor`` (float64) with its ``axis`` mapped through ``q`` (d × k): t·q along that axis."""
    return (tensor.movedim(axis, -1) @ q).movedim(-1, axis)


def sliced_block(block: dict, stream: StreamMap, k: int, *, fraction: float, basis: str) -> dict:
    """The sliced model's ``normswap`` config block: norms k wide with ε·d/k, nothing centred or
    restored any more, no logits bias derived from the norm, and the ``slice`` entry that narrows a
    freshly built model (remote_code.apply_slice_structure)."""
    d = stream.hidden_size
    out = copy.deepcopy(block)
    adapter = stream.tied_head is not None and bool(stream.norms[stream.tied_norm].get("weight"))
    for name, rec in out["norms"].items():
        rec["hidden_size"] = k
        rec["eps"] = float(rec["eps"]) * d / k
        rec.pop("restore", None)
        rec.pop("logits_bias", None)
        if name == stream.tied_norm:
            rec["weight"] = not adapter  # c = sqrt(d/k) as the norm's weight, or inside the adapter with γ
            rec["bias"] = False
            rec["gamma"] = "fold" if adapter else rec["gamma"]
            rec["why"] = (
                "γ and β moved into the tied head's adapter and bias (normswap slice)"
                if adapter
                else "the norm-width gain sqrt(d/k) kept as the norm's weight: its reader is the tied table"
            )
    if stream.embedding_norm:  # precomputed into the table: gone from the sliced model
        out["norms"].pop(stream.embedding_norm, None)
        out["tied"] = False  # the table now holds the normalised rows; the head its own copy of the raw ones
    out["logits_bias"] = {}
    out["centered_outputs"] = [n for n in out.get("centered_outputs", []) if n not in stream.rotated_outputs]
    out["stream_writers"] = {"zero_mean": {}, "unit_scales": list(stream.unit_scales)}
    out["slice"] = {
        "width": int(k),
        "hidden_size": int(d),
        "fraction": float(fraction),
        "basis": basis,
        "stream_dims": stream.stream_dims(),
    }
    if adapter:
        out["slice"]["head_adapter"] = {"head": stream.tied_head, "norm": stream.tied_norm}
    if stream.embedding_norm:
        out["slice"]["embedding_norm"] = stream.embedding_norm
        out["slice"]["head_copy"] = stream.head_copy
    return out


def sliced_tensors(model, stream: StreamMap, k: int, q_for) -> dict[str, torch.Tensor]:
    """{state-dict key: float64 tensor} of every tensor the rotation changes or adds; ``q_for(key)``
    is the full d × d basis that applies to that parameter (one basis for all by default)."""
    d = stream.hidden_size
    c = math.sqrt(d / k)
    state = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for key, axes in stream.stream_dims().items():
        if key in stream.unit_scales:
            out[key] = torch.ones(k, dtype=torch.float64)
            continue
        if key == stream.embedding_table and stream.embedding_norm:
            t = normalised_table(model, stream)  # what the stream starts from, per token
        else:
            t = _tensor(model, state, key).detach().to(torch.float64).cpu()
        qk = q_for(key)[:, :k]
        for axis in axes:
            t = contract(t, axis, qk)
        if key in stream.reads:
            t = t * c
        out[key] = t
    if stream.tied_head is not None:
        out.update(_tied_head_tensors(model, stream, k, q_for, state))
    return out


def normalised_table(model, stream: StreamMap) -> torch.Tensor:
    """The embedding norm's output for every token id (float64, centred): the stream's start, which
    depends on the token alone, so one table holds it (BLOOM's word_embeddings_layernorm over its
    table). The modules run as the conversion runs them (the table's and the norm's run-time centring
    included), on float64 copies."""
    owner = stream.embedding_table.rpartition(".")[0]
    embed = copy.deepcopy(model.get_submodule(owner)).double().cpu()
    norm = copy.deepcopy(model.get_submodule(stream.embedding_norm)).double().cpu()
    with torch.no_grad():
        table = norm(embed(torch.arange(embed.weight.shape[0])))
    return table - table.mean(dim=-1, keepdim=True)


def _tensor(model, state, key) -> torch.Tensor:
    """``key``'s tensor: from the state dict, or (a computed table, not persistent) from its module."""
    if key in state:
        return state[key]
    owner, _, attr = key.rpartition(".")
    return getattr(model.get_submodule(owner), attr)


def _tied_head_tensors(model, stream: StreamMap, k: int, q_for, state) -> dict[str, torch.Tensor]:
    d = stream.hidden_size
    c = math.sqrt(d / k)
    norm, head = stream.tied_norm, stream.tied_head
    rec = stream.norms[norm]
    if not rec.get("weight"):
        return {f"{norm}.weight": torch.full((k,), c, dtype=torch.float64)}
    q = q_for(stream.tied_table)
    qk, u = q[:, :k], torch.full((d,), 1.0 / math.sqrt(d), dtype=torch.float64)
    gamma = state[f"{norm}.weight"].detach().to(torch.float64).cpu()
    table = state[stream.tied_table].detach().to(torch.float64).cpu()  # the original, uncentred table
    beta = state.get(f"{norm}.folded_bias")
    bias = torch.zeros(table.shape[0], dtype=torch.float64)
    if beta is not None:
        bias += table @ beta.detach().to(torch.float64).cpu()  # the logits bias E·β, exact at every k
    own = getattr(model.get_submodule(head), "bias", None)
    if isinstance(own, torch.nn.Parameter):
        bias += own.detach().to(torch.float64).cpu()
    return {
        f"{head}.adapter": c * (qk.T * gamma) @ qk,
        f"{head}.adapter_u": c * qk.T @ (gamma * u),
        f"{head}.row_means": table @ u,
        f"{head}.bias": bias,
    }


def _source_class(model):
    """The transformers class a converted model was built from (normswap's classes subclass it)."""
    cls = type(model)
    while cls.__name__.startswith("Normswap") and len(cls.__mro__) > 1:
        cls = cls.__mro__[1]
    return cls


def build_sliced(model, block: dict, tensors: dict[str, torch.Tensor]):
    """A fresh model of ``model``'s class with the sliced ``block``, holding ``model``'s tensors with
    ``tensors`` in place of those the rotation changed; ``model`` itself is left as it was."""
    from transformers.initialization import no_init_weights

    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    config = copy.deepcopy(model.config)
    config.normswap = block
    if block.get("slice", {}).get("head_copy"):  # the head keeps its own table: loading must not tie it again
        config.tie_word_embeddings = False
    cls = type(model)
    with no_init_weights():
        if cls.__name__.startswith("Normswap"):
            new = cls(config)  # its __init__ applies the normswap structure, as loading does
        else:
            new = _source_class(model)(config)
            apply_normswap_structure(new, block)
    new = new.to(dtype=dtype, device=device)
    state = {key: t for key, t in model.state_dict().items()}
    values, seen = {}, set()
    for key, ref in new.state_dict(keep_vars=True).items():
        if id(ref) in seen:  # a tied duplicate (the head's view of the table): loaded through its first name
            continue
        seen.add(id(ref))
        value = tensors.get(key)
        if value is None:
            value = state.get(key)
        if value is None:
            continue
        if tuple(value.shape) != tuple(ref.shape):
            raise NormswapError(
                f"internal error: sliced {key} is {tuple(value.shape)}, the model holds {tuple(ref.shape)}"
            )
        values[key] = value.to(dtype=ref.dtype, device=device)
    with torch.no_grad():
        missing, unexpected = new.load_state_dict(values, strict=False)
    params = dict(new.named_parameters(remove_duplicate=True))
    missing = [key for key in missing if key in params]
    if missing or unexpected:
        raise NormswapError(f"internal error: the sliced weights do not fit the sliced model (missing {missing[:3]})")
    new.train(model.training)
    for attr in ("normswap_manifest", "normswap_source_dir"):
        if hasattr(model, attr):
            setattr(new, attr, getattr(model, attr))
    return new
