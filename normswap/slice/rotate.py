"""Rotate and slice: the sliced model's config block and tensors, and the model built from them.

Row-vector convention (the shared algebra, docs/slice.md: a writer adds h·W_out + b_out to the stream, a
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
    state = model.state_dict()

    def raw(key):
        value = _tensor(model, state, key)
        return None if value is None else value.detach().to(torch.float64).cpu()

    def read(key):
        if key in stream.unit_scales:  # set to k ones: nothing to read
            return None
        if key == stream.embedding_table and stream.embedding_norm:
            return normalised_table(model, stream)  # what the stream starts from, per token
        return raw(key)

    out = {key: rotated_tensor(key, read(key), stream, k, q_for(key)) for key in stream.stream_dims()}
    if stream.tied_head is not None:
        own = getattr(model.get_submodule(stream.tied_head), "bias", None)
        own = own.detach().to(torch.float64).cpu() if isinstance(own, torch.nn.Parameter) else None
        out.update(head_tensors(raw, stream, k, q_for(stream.tied_table), own))  # the raw table
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
    try:
        return getattr(model.get_submodule(owner), attr, None)
    except AttributeError:  # no such module: the model has no such tensor (a head without a folded β)
        return None


def rotated_tensor(key: str, value: torch.Tensor | None, stream: StreamMap, k: int, q: torch.Tensor) -> torch.Tensor:
    """One tensor of the stream map rotated and kept ``k`` wide: ``value`` (the conversion's tensor,
    in the arithmetic dtype: float64, or float32 where the output is 16-bit) contracted with Q_k
    along every stream axis, times c = sqrt(d/k) for a reader; a unit scale is k ones. The one
    place a tensor is rotated, for the in-memory and the streamed path alike."""
    if key in stream.unit_scales:
        return torch.ones(k, dtype=value.dtype if value is not None else torch.float64)
    qk = q[:, :k].to(dtype=value.dtype, device=value.device)
    t = value
    for axis in stream.writes_and_reads(key):
        t = contract(t, axis, qk)
    if key in stream.reads:
        t = t * math.sqrt(stream.hidden_size / k)
    return t


def narrowed(key: str, rotated: torch.Tensor, stream: StreamMap, k: int, w: int, *, rows_kept=False) -> torch.Tensor:
    """``rotated`` (``rotated_tensor`` at a wider width ``w``) kept ``k`` wide: its first k entries
    along every stream axis (Q_k is the first k columns of Q_w), a reader's gain moved from
    sqrt(d/w) to sqrt(d/k). ``rows_kept``: ``rotated`` is a block of rows already within the kept
    ones (axis 0 is not narrowed again)."""
    t = rotated
    for axis in stream.writes_and_reads(key):
        if not (rows_kept and axis == 0):
            t = t.narrow(axis, 0, k)
    if key in stream.reads and w != k:
        t = t * math.sqrt(w / k)
    return t


def head_tensors(read, stream: StreamMap, k: int, q: torch.Tensor, own_bias=None) -> dict[str, torch.Tensor]:
    """The tied head's tensors at width ``k`` (float64): the final norm's weight c, or the adapter
    (R, g, m, b) of remote_code._SlicedTiedHead. ``read(key)``: the conversion's tensor in float64
    (None where it has none); ``own_bias``: the conversion's head bias, if it has one."""
    d = stream.hidden_size
    c = math.sqrt(d / k)
    norm, head = stream.tied_norm, stream.tied_head
    rec = stream.norms[norm]
    if not rec.get("weight"):
        return {f"{norm}.weight": torch.full((k,), c, dtype=torch.float64)}
    qk, u = q[:, :k], torch.full((d,), 1.0 / math.sqrt(d), dtype=torch.float64)
    gamma = read(f"{norm}.weight")
    table = read(stream.tied_table)  # the original, uncentred table
    beta = read(f"{norm}.folded_bias")
    bias = torch.zeros(table.shape[0], dtype=torch.float64)
    if beta is not None:
        bias += table @ beta  # the logits bias E·β, exact at every k
    if own_bias is not None:
        bias += own_bias
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
