"""A tied embedding centred without a hook (#26): the converted GPT-2's token table is a
_CenteredEmbedding whose per-token path subtracts cached row means; it must compute exactly what
the hook did (the source's logits, float64), through the KV cache, with and without gradient,
and after the table changes in place."""

import copy

import pytest
import torch
from helpers import tiny_model
from torch import nn

from normswap import kernels
from normswap.checkpoint.remote_code import _center_output_hook, _CenteredEmbedding
from normswap.testing import kernel_backend


def _convert(tmp_path, run_cli):
    model = tiny_model("gpt2", 0)
    model.save_pretrained(tmp_path / "src")
    code, _, _ = run_cli("convert", tmp_path / "src", tmp_path / "out")
    assert code == 0
    import normswap

    return model.double().eval(), normswap.load_model(str(tmp_path / "out")).double().eval()


def _greedy_logits(model, ids, steps=6):
    """Per-step logits of greedy decode through the KV cache (the per-token path)."""
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        rows = [out.logits[:, -1]]
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=token, use_cache=True, past_key_values=out.past_key_values)
            rows.append(out.logits[:, -1])
    return torch.stack(rows)


def test_tied_embedding_is_centred_without_a_hook_and_exact(tmp_path, run_cli):
    source, converted = _convert(tmp_path, run_cli)
    wte = converted.transformer.wte
    assert type(wte) is _CenteredEmbedding and not wte._forward_hooks
    assert converted.lm_head.weight is wte.weight  # still tied: only the class changed
    ids = torch.randint(0, source.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    # the same weights centred by the output hook it replaces: float64 agreement to rounding
    hooked = copy.deepcopy(converted)
    hooked.transformer.wte.__class__ = nn.Embedding
    hooked.transformer.wte.register_forward_hook(_center_output_hook)
    want = _greedy_logits(hooked, ids)
    got = _greedy_logits(converted, ids)  # cached-means path
    assert float((got - want).abs().max()) < 1e-12
    # and the source's (the weights were converted in float32: its rounding, not the method's)
    assert float((got - _greedy_logits(source, ids)).abs().max()) < 1e-6
    with torch.enable_grad():  # the gradient path: the plain formula
        wte.weight.requires_grad_(True)
        assert float((converted(input_ids=ids).logits - hooked(input_ids=ids).logits).abs().max()) < 1e-12
    # negative control: the same model with the table left uncentred is not exact
    plain = copy.deepcopy(converted)
    plain.transformer.wte.__class__ = nn.Embedding
    assert float((_greedy_logits(plain, ids) - want).abs().max()) > 1e-4


def test_cached_row_means_follow_in_place_changes():
    # the fallback path (no compiled lookup: CUDA, bf16, NORMSWAP_KERNEL=torch, no compiler)
    with kernel_backend("torch"):
        _cached_row_means_follow_in_place_changes()


def _cached_row_means_follow_in_place_changes():
    torch.manual_seed(0)
    emb = nn.Embedding(50, 16).double()
    emb.__class__ = _CenteredEmbedding
    ids = torch.tensor([[3, 7, 3]])

    def centred():
        rows = emb.weight.detach()[ids]
        return rows - rows.mean(-1, keepdim=True)

    with torch.inference_mode():
        assert torch.allclose(emb(ids), centred(), atol=1e-14, rtol=0)
    with torch.no_grad():  # an optimizer step or load_state_dict: the table changes in place
        emb.weight.add_(torch.randn_like(emb.weight))
    with torch.inference_mode():
        assert torch.allclose(emb(ids), centred(), atol=1e-14, rtol=0)
        # negative control: means that ignore the change (stale cache) give the wrong rows
        stale = emb._row_means_of
        emb._row_means = emb._row_means + 0.5
        assert emb._row_means_of == stale and not torch.allclose(emb(ids), centred(), atol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-14)])
def test_compiled_centred_lookup_is_one_call_and_exact(monkeypatch, dtype, tol):
    """Per decoded token on CPU the table's rows are looked up and centred by one compiled call
    (the decode cost of #32), equal to the formula, after in-place changes too."""
    from normswap.kernels import implementations as registry

    if not registry.cpu_ready():
        pytest.skip("no compiled CPU kernel on this machine")
    torch.manual_seed(0)
    emb = nn.Embedding(300, 96).to(dtype)
    emb.__class__ = _CenteredEmbedding
    ids = torch.tensor([[3], [299]])
    calls = []
    real = kernels.centered_rows
    monkeypatch.setattr("normswap.checkpoint.remote_code._centered_rows", lambda t, i: calls.append(1) or real(t, i))

    def centred():
        rows = emb.weight.detach()[ids].double()
        return rows - rows.mean(-1, keepdim=True)

    with torch.inference_mode():
        got = emb(ids)
        assert got.dtype == dtype and got.shape == (2, 1, 96)
        assert float((got.double() - centred()).abs().max()) < tol
        with torch.no_grad():
            emb.weight.add_(1.0)  # a shifted table: the centred rows do not move
        assert float((emb(ids).double() - centred()).abs().max()) < tol
        assert emb._row_means is None  # the compiled call keeps no cache that could go stale
        with pytest.raises(IndexError):
            emb(torch.tensor([[300]]))
    assert calls and kernels.centered_rows(emb.weight, ids) is not None
    # negative control: the formula's rows without centring differ from the compiled call's
    with torch.inference_mode():
        assert float((nn.functional.embedding(ids, emb.weight).double() - emb(ids).double()).abs().max()) > 0.5
