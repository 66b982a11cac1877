"""Perplexity: the windowing, its independence from batch size, agreement with a direct
computation, with lm-eval, and across an exact conversion."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_evaluate_fixtures import kjv_tokenizer, tiny_gpt2

from normswap.data import load_documents, load_text
from normswap.errors import NormswapError
from normswap.evaluate.perplexity import document_perplexity, perplexity, prefix_token_id, truncate_text, window_plan


@pytest.fixture(scope="module")
def tok():
    return kjv_tokenizer()


@pytest.fixture(scope="module")
def text():
    return load_text("embedded", "test")[:3000]


@pytest.mark.parametrize(
    "length,seq_len,stride", [(2, 4, 4), (10, 4, 4), (11, 4, 4), (37, 8, 3), (100, 16, 16), (101, 16, 1), (5, 64, 32)]
)
def test_window_plan_scores_every_token_once_with_context(length, seq_len, stride):
    plan = window_plan(length, seq_len, stride)
    scored = []
    for begin, end, first in plan:
        assert 0 < end - begin <= seq_len
        assert begin + 1 <= first <= end  # every scored id has at least one id of context
        scored += list(range(first, end + 1))
    assert scored == list(range(1, length))


def test_window_plan_rejects_bad_settings():
    with pytest.raises(NormswapError):
        window_plan(10, 8, 9)
    with pytest.raises(NormswapError):
        window_plan(10, 8, 0)


def _hand_perplexity(model, tokenizer, text, seq_len, shift=1):
    """Disjoint windows computed independently: transformers' own loss on each window."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    seq = [prefix_token_id(tokenizer)] + ids
    nll, count = 0.0, 0
    with torch.no_grad():
        for begin in range(0, len(seq) - 1, seq_len):
            window = torch.tensor(seq[begin : begin + seq_len + 1])
            inputs, targets = window[:-1], window[shift:][: len(window) - 1]
            logits = model(input_ids=inputs[None]).logits[0]
            n = min(len(targets), len(logits))
            nll += float(torch.nn.functional.cross_entropy(logits[:n], targets[:n], reduction="sum"))
            count += n
    return math.exp(nll / count), count


def test_disjoint_windows_equal_direct_computation(tok, text):
    model = tiny_gpt2(seed=3)
    seq_len = 32
    ids = tok(text, add_special_tokens=False)["input_ids"]
    # Cut the text to a whole number of windows so the hand computation has no ragged end.
    cut = tok.decode(ids[: 12 * seq_len])
    assert tok(cut, add_special_tokens=False)["input_ids"] == ids[: 12 * seq_len]
    expected, count = _hand_perplexity(model, tok, cut, seq_len)
    got = perplexity(model, tok, cut, seq_len=seq_len, stride=seq_len, batch_size=4)
    assert got.tokens == count == 12 * seq_len
    assert got.perplexity == pytest.approx(expected, rel=1e-5)
    # Negative control: scoring each token against itself (an off-by-one target shift) is far off.
    wrong, _ = _hand_perplexity(model, tok, cut, seq_len, shift=0)
    assert abs(wrong / got.perplexity - 1) > 0.01


def test_batch_size_does_not_change_the_result(tok, text):
    model = tiny_gpt2(seed=1)
    results = [perplexity(model, tok, text[:1500], seq_len=48, stride=16, batch_size=b) for b in (1, 3, 8)]
    for r in results[1:]:
        assert r.perplexity == pytest.approx(results[0].perplexity, rel=1e-6)
        assert (r.tokens, r.windows) == (results[0].tokens, results[0].windows)


def test_stride_does_not_change_what_is_scored(tok, text):
    model = tiny_gpt2(seed=1)
    short = text[:120]
    n = len(tok(short, add_special_tokens=False)["input_ids"])
    # The text fits one window: every stride gives the same number.
    same = [perplexity(model, tok, short, seq_len=n + 4, stride=s) for s in (1, 7, n + 4)]
    for r in same[1:]:
        assert r.perplexity == pytest.approx(same[0].perplexity, rel=1e-6)
    # Longer text: every stride scores every token exactly once, but with different context.
    a = perplexity(model, tok, text, seq_len=32, stride=32)
    b = perplexity(model, tok, text, seq_len=32, stride=8)
    assert a.tokens == b.tokens == len(tok(text, add_special_tokens=False)["input_ids"])
    assert a.bytes == b.bytes == len(text.encode())
    assert a.perplexity != b.perplexity


def test_bits_per_byte_and_word_perplexity_follow_from_the_nll(tok, text):
    r = perplexity(tiny_gpt2(), tok, text, seq_len=64, stride=32)
    assert r.bits_per_byte == pytest.approx(r.nll_nats / math.log(2) / len(text.encode("utf-8")))
    assert r.word_perplexity == pytest.approx(math.exp(r.nll_nats / len(text.split())))
    assert r.perplexity == pytest.approx(math.exp(r.nll_nats / r.tokens))


def test_cap_cuts_at_a_word_boundary_within_the_token_budget(tok, text):
    capped, truncated = truncate_text(text, tok, 200)
    assert truncated and text.startswith(capped)
    assert len(tok(capped, add_special_tokens=False)["input_ids"]) <= 200
    assert text[len(capped)] in " \n"
    assert truncate_text(text, tok, 0) == (text, False)
    assert truncate_text(text[:50], tok, 10_000) == (text[:50], False)


def test_lm_eval_rolling_loglikelihood_matches(tok):
    """lm-eval's number on the shipped task equals normswap's with matching windows.

    lm-eval scores each document on its own with windows of max_length tokens, each predicting
    max_length new tokens with the last window right-aligned - normswap's seq_len == stride.
    """
    from normswap.evaluate.lm_eval_adapter import run_tasks

    model = tiny_gpt2(seed=2)
    scores = run_tasks(model, tok, "normswap_kjv", batch_size=8, max_length=128, limit=2, device="cpu")["normswap_kjv"]
    docs = [d.strip() for d in load_documents("embedded", "test")][:2]
    assert all(len(tok(d)["input_ids"]) > 3 * 128 for d in docs)  # several windows, ragged end
    ours = document_perplexity(model, tok, docs, seq_len=128, stride=128)
    assert scores["bits_per_byte"] == pytest.approx(ours.bits_per_byte, rel=1e-5)
    assert scores["word_perplexity"] == pytest.approx(ours.word_perplexity, rel=1e-4)
    assert scores["byte_perplexity"] == pytest.approx(2**ours.bits_per_byte, rel=1e-5)
    # Negative control: different windows (more context per token) give a different number.
    other = document_perplexity(model, tok, docs, seq_len=128, stride=64)
    assert abs(other.bits_per_byte / scores["bits_per_byte"] - 1) > 1e-4


def test_exact_conversion_keeps_perplexity_and_approx_does_not(tok, text):
    from normswap.convert import convert_model

    source = tiny_gpt2(seed=4)
    base = perplexity(source, tok, text, seq_len=64, stride=32)
    exact = copy.deepcopy(source)
    convert_model(exact, mode="exact")
    assert any(type(m).__name__ == "RMSNorm" for m in exact.modules())
    assert perplexity(exact, tok, text, seq_len=64, stride=32).perplexity == pytest.approx(base.perplexity, rel=1e-4)
    approx = copy.deepcopy(source)
    convert_model(approx, mode="approx")
    # (a random model is near-uniform, so even approx moves its perplexity only ~1e-3)
    assert abs(perplexity(approx, tok, text, seq_len=64, stride=32).perplexity / base.perplexity - 1) > 2e-4
