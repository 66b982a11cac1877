"""Thin evidence said out loud (#32): perplexity differences carry a block-bootstrap interval, an
evaluation on little held-out text writes results.json ``warnings``, the fine-tune's header says
how many passes it makes over its training text, and the split rule recorded is the one applied."""

from __future__ import annotations

import torch

from normswap.assets.models import model_path


def _paragraphs(n: int, words: int = 50) -> str:
    from normswap.data import load_text

    w = load_text("embedded", "test").split()
    return "\n\n".join(" ".join(w[i * words : (i + 1) * words]) for i in range(n)) + "\n"


def test_intervals_resolve_a_real_difference_and_not_noise():
    from normswap.evaluate.quality_intervals import ratio_intervals, thin_evidence

    gen = torch.Generator().manual_seed(1)
    base = torch.rand(4096, generator=gen, dtype=torch.float64) * 8
    worse = base + 0.05  # every token 0.05 nats worse: perplexity x1.051, a real difference
    noisy = base + (torch.rand(4096, generator=gen, dtype=torch.float64) - 0.5) * 0.4  # no change on average
    iv = ratio_intervals(worse, base, n_bytes=20000)["perplexity"]
    assert iv["low"] > 1.0 and abs(iv["low"] - 1.0513) < 0.001 and abs(iv["high"] - 1.0513) < 0.001
    iv_noise = ratio_intervals(noisy, base, n_bytes=20000)["perplexity"]
    assert iv_noise["low"] < 1.0 < iv_noise["high"]  # negative control: noise is not a difference
    assert ratio_intervals(worse, base, n_bytes=20000) == ratio_intervals(worse, base, n_bytes=20000)  # seeded

    def rows(ratio, iv):
        return [
            {"name": "base"},
            {"name": "m", "ratios": {"perplexity": ratio}, "quality_intervals": {"perplexity": iv}},
        ]

    assert thin_evidence(rows(1.0513, iv), "base", 50_000) == []  # plenty of text, a resolved difference
    [w] = thin_evidence(rows(1.02, iv_noise), "base", 50_000)
    assert w.startswith("m: perplexity +2.00 % against base is not a measured difference") and "contains no change" in w
    [w] = thin_evidence(rows(1.0513, iv), "base", 1_280)
    assert "only 1,280 held-out tokens were scored" in w


def test_an_eval_on_thirty_short_paragraphs_warns_and_records_what_it_scored(tmp_path):
    from normswap.evaluate.config import EvalConfig
    from normswap.evaluate.side_by_side import evaluate, load_planned, plan_entries

    text = tmp_path / "thirty.txt"
    text.write_text(_paragraphs(30))
    src = str(model_path("kjv-gpt2"))
    planned, base = plan_entries([f"original={src}", f"again={src}"], "original")
    entries = load_planned(planned)
    cfg = EvalConfig(speed=False, memory=False, diagnostics=False, max_tokens=65536)
    results = evaluate(entries, cfg, data=str(text), baseline_name=base)
    assert results["warnings"] and "held-out tokens were scored" in results["warnings"][0]
    tokens = results["models"][0]["perplexity_detail"]["tokens"]
    assert results["data"]["eval_tokens"] == tokens < 65536  # what was scored, not the cap
    again = results["models"][1]
    assert again["quality_intervals"]["perplexity"]["low"] == again["quality_intervals"]["perplexity"]["high"] == 1.0
    assert results["models"][0]["quality_intervals"] is None  # the baseline has no change of its own


def test_finetune_header_counts_passes_and_warns_past_a_few(tmp_path):
    import normswap
    from normswap.finetune.batches import corpus_header

    tok = normswap.load_tokenizer(model_path("kjv-gpt2"))
    text = tmp_path / "thirty.txt"
    text.write_text(_paragraphs(30, words=400))  # ~15 documents
    lines, passes = corpus_header(tok, str(text), "train", 1280, str(text), "validation", 200 * 8 * 128)
    assert "documents to train on" in lines[0] and "passes over the training text" in lines[0]
    assert passes > 4 and lines[-1].startswith("warning: ") and "fewer --steps" in lines[-1]
    lines, passes = corpus_header(tok, str(text), "train", 1280, str(text), "validation", 64)
    assert passes < 1 and not any(line.startswith("warning") for line in lines)  # control: one short step


def test_the_embedded_count_is_kept_per_tokenizer_and_a_local_file_is_read_again(tmp_path, monkeypatch):
    """The header's token count of the embedded corpus is taken once per tokenizer in a process
    (finetune/batches.py _split_counts); another tokenizer, or a local file (it may change), is counted again."""
    import normswap
    import normswap.data
    from normswap.finetune import batches

    monkeypatch.setattr(batches, "HEADER_TOKENISED_CHARS", 20_000)  # a short count: the rule, not the corpus
    monkeypatch.setattr(batches, "_EMBEDDED_COUNTS", {})
    reads, real = [], normswap.data.load_documents

    def load_documents(spec, split, **kw):
        reads.append((str(spec), split))
        return real(spec, split, **kw)

    monkeypatch.setattr(normswap.data, "load_documents", load_documents)
    tok = normswap.load_tokenizer(model_path("kjv-gpt2"))
    first = batches.corpus_header(tok, "embedded", "train", 1024, "embedded", "validation", 4096)
    assert batches.corpus_header(tok, "embedded", "train", 1024, "embedded", "validation", 4096) == first
    assert reads.count(("embedded", "train")) == 1  # the second header did not read the training split
    # negative control: a tokenizer with one more token is another count, taken afresh
    other = normswap.load_tokenizer(model_path("kjv-gpt2"))
    other.add_tokens(["qqzzyx"])
    batches.corpus_header(other, "embedded", "train", 1024, "embedded", "validation", 4096)
    assert reads.count(("embedded", "train")) == 2
    text = tmp_path / "t.txt"
    text.write_text(_paragraphs(30, words=400))
    for _ in range(2):
        batches.corpus_header(tok, str(text), "train", 64, str(text), "validation", 64)
    assert reads.count((str(text), "train")) == 2


def test_the_split_rule_recorded_is_the_one_applied(tmp_path, capsys):
    from normswap.data.sources import HASH_RULE
    from normswap.finetune.batches import training_data_record

    small = tmp_path / "small.txt"
    small.write_text(_paragraphs(15, words=300))  # 5 documents, all hashed into train
    rule = training_data_record(str(small), "train")["rule"]
    assert rule != HASH_RULE and "held out instead" in rule and "never these" in rule
    notice = capsys.readouterr().err
    assert "never trained on" not in notice and "training reads the other" in notice
    big = tmp_path / "big.txt"
    big.write_text(_paragraphs(400, words=400))  # control: enough documents for the hash alone
    assert training_data_record(str(big), "train")["rule"] == HASH_RULE


def test_finetune_says_what_it_reads_before_the_model_loads(tmp_path, run_cli, monkeypatch):
    """The first lines come before the model loads (a stand-in loader stops the run there); bad
    options still get their one line and nothing else."""
    from normswap.checkpoint import load
    from normswap.errors import NormswapError

    def stop(*args, **kwargs):
        raise NormswapError("stand-in: the model would load now")

    monkeypatch.setattr(load, "load_model", stop)
    text = tmp_path / "thirty.txt"
    text.write_text(_paragraphs(30, words=400))
    args = ("finetune", model_path("kjv-gpt2"), tmp_path / "out", "--data", text, "--seq-len", "64")
    code, _, err = run_cli(*args, "--steps", "200")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and lines[-1].endswith("stand-in: the model would load now"), err
    said = "\n".join(lines[:-1])
    assert "reading the data, then loading the model" in said and "passes over the training text" in said
    assert "warning: " in said and said.rstrip().endswith("loading the model")
    code, _, err = run_cli(*args, "--steps", "2")  # control: a short run makes no pass warning
    assert code == 2 and "passes over the training text" in err and "warning: " not in err
    code, _, err = run_cli(*args, "--lr", "0")  # bad input: one line, no header
    assert code == 2 and [line for line in err.splitlines() if line.strip()] == [err.strip()]
    assert "--lr must be > 0" in err


def test_a_run_capped_at_the_threshold_is_not_called_thin(tmp_path):
    """Seen on the GPU (results/gpu-h200-evidence-20261204T1929Z/): a run capped at 16,384 tokens warned
    "only 16,383 held-out tokens were scored (fewer than 16,384)". The cause: the cap cuts the text on a
    word boundary (truncate_text drops the word it split), so the text holds fewer tokens than the cap
    and the threshold compared them as if the text had run out. Negative controls: the same count
    uncapped, and a cap below the threshold, still warn."""
    from normswap.evaluate.config import EvalConfig
    from normswap.evaluate.quality_intervals import THIN_TOKENS, thin_evidence
    from normswap.evaluate.side_by_side import evaluate, load_planned, plan_entries

    entries = load_planned(plan_entries([f"original={model_path('kjv-gpt2')}"], "original")[0])
    cfg = EvalConfig(speed=False, memory=False, diagnostics=False, max_tokens=THIN_TOKENS, seq_len=128)
    results = evaluate(entries, cfg, data="embedded", baseline_name="original")
    assert results["data"]["truncated"] and results["data"]["eval_tokens"] < THIN_TOKENS  # the word boundary
    assert not any("held-out tokens were scored" in w for w in results["warnings"])
    rows = [{"name": "original"}]
    assert thin_evidence(rows, "original", THIN_TOKENS - 1, capped_at=THIN_TOKENS) == []
    assert thin_evidence(rows, "original", THIN_TOKENS - 1)  # the same count, not cut by a cap
    assert thin_evidence(rows, "original", 8189, capped_at=8192)  # a cap below the threshold is thin
