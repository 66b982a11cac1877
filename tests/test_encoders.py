"""Encoders end to end (issue #12): eval report by fidelity, refusals, masking, healing.

Models are tiny real BertForMaskedLM / BertModel built from the bert family's test config, with a
WordPiece vocabulary trained here on the embedded corpus; conversion is the real approximate one.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from normswap.errors import NormswapError


def _wordpiece():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from normswap.data import load_documents

    tk = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.train_from_iterator(itertools.islice(load_documents("embedded", "train"), 30),
                           trainers.WordPieceTrainer(vocab_size=256, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", tk.token_to_id("[CLS]")), ("[SEP]", tk.token_to_id("[SEP]"))])
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """{name: dir}: a masked-LM BERT and a bare BertModel, each with its approximate conversion."""
    from normswap.convert.pipeline import convert_checkpoint
    from normswap.testing import tiny_model

    root = tmp_path_factory.mktemp("encoders")
    tok = _wordpiece()
    dirs = {}
    for task, name in (("masked-lm", "mlm"), ("base", "enc")):
        src = root / name
        tiny_model("bert", task=task, randomize=False, seed=1).save_pretrained(src)
        tok.save_pretrained(src)
        convert_checkpoint(str(src), str(root / f"{name}-approx"), mode="approx", beta="drop", force=True)
        dirs[name], dirs[f"{name}-approx"] = src, root / f"{name}-approx"
    return dirs


QUICK_SPEED = ("--repeats", "1", "--warmup", "0", "--min-time", "0", "--seq-len", "32", "--batch-size", "2", "--max-tokens", "2048")


def test_eval_report_measures_encoders_by_fidelity(encoders, tmp_path, run_cli):
    out = tmp_path / "rep"
    code, stdout, err = run_cli("eval", "report", f"orig={encoders['mlm']}", f"approx={encoders['mlm-approx']}", "--baseline", "orig",
                                "--out", out, "--quiet", *QUICK_SPEED)
    assert code == 0, err
    res = json.loads((out / "results.json").read_text())
    rows = {m["name"]: m for m in res["models"]}
    orig, approx = rows["orig"]["fidelity"], rows["approx"]["fidelity"]
    assert orig["hidden_cosine"] == pytest.approx(1.0, abs=1e-6) and orig["top1_agreement"] == 1.0
    assert orig["embedding_cosine_min"] == pytest.approx(1.0, abs=1e-6)
    # the approximate conversion is measurably not the source (a metric that compared a model with
    # itself would give 1.0 here)
    assert approx["hidden_cosine"] < 0.9999 and approx["embedding_cosine_min"] <= approx["embedding_cosine"] < 1.0
    assert 0 <= approx["top1_agreement"] <= 1 and approx["masked_perplexity"] > 1
    assert all(m["perplexity"] is None and m["model_kind"] == "masked-lm" for m in rows.values())
    assert rows["approx"]["tokens_per_second"]["train_step"] > 0 and "generate" not in rows["approx"]["tokens_per_second"]
    md = (out / "report.md").read_text()
    assert "## Fidelity to orig" in md and (out / "fidelity.png").is_file()
    assert "embedding cosine (mean)" in stdout and "approx" in stdout


def test_bare_encoder_has_no_masked_metrics_and_mixed_kinds_are_refused(encoders, tmp_path, run_cli):
    out = tmp_path / "rep"
    code, _, err = run_cli("eval", "report", str(encoders["enc"]), str(encoders["enc-approx"]), "--baseline", str(encoders["enc"]),
                           "--out", out, "--quiet", "--no-speed", "--no-memory", "--seq-len", "32", "--max-tokens", "2048")
    assert code == 0, err
    rows = json.loads((out / "results.json").read_text())["models"]
    assert [r["model_kind"] for r in rows] == ["encoder", "encoder"]
    assert rows[1]["fidelity"]["top1_agreement"] is None and rows[1]["fidelity"]["embedding_cosine"] < 1.0
    # an encoder and a causal LM have nothing in common to compare: one line, exit 2, nothing written
    code, _, err = run_cli("eval", "report", "normswap:kjv-gpt2", str(encoders["mlm"]), "--out", tmp_path / "mixed", "--quiet")
    assert code == 2 and "cannot compare causal LMs (kjv-gpt2) with encoders (mlm)" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "mixed" / "results.json").exists()
    code, _, err = run_cli("eval", "ppl", str(encoders["mlm"]), "--quiet")
    assert code == 2 and "perplexity is not defined for encoders" in err


def test_fidelity_reads_a_whole_user_file(encoders, tmp_path):
    """`eval` on a user's text file reads all of it (no hash split), verse-per-line included."""
    import normswap
    from normswap.data import default_eval_split
    from normswap.data import kjv
    from normswap.evaluate.runner import ModelEntry, evaluate

    path = tmp_path / "heldout.txt"
    path.write_text("\n".join(list(kjv.verses("test"))[:60]) + "\n")
    entries = [ModelEntry(name=n, spec=str(encoders[n]), model=normswap.load_model(str(encoders[n]), task="auto"),
                          tokenizer=normswap.load_tokenizer(str(encoders[n]))) for n in ("mlm", "mlm-approx")]
    res = evaluate(entries, data=str(path), split=default_eval_split(str(path)), baseline_name="mlm", seq_len=32,
                   speed=False, memory=False)
    assert res["data"]["split"] == "all" and res["data"]["words"] == len(path.read_text().split())  # every word read
    assert res["fidelity_setup"]["sentences"] >= 55


# ---------------------------------------------------------------- masking


def test_masking_is_bert_style_seeded_per_row_and_skips_special_tokens(encoders):
    from normswap.finetune.encoder_objectives import frame, mask_tokens

    import normswap

    tok = normswap.load_tokenizer(str(encoders["mlm"]))
    g = torch.Generator().manual_seed(0)
    ids = frame(torch.randint(5, 256, (64, 128), generator=g), tok)
    inputs, labels = mask_tokens(ids, tok, seed=3)
    chosen = labels != -100
    assert 0.12 < chosen.float().mean().item() < 0.18
    assert not chosen[:, 0].any() and not chosen[:, -1].any()  # [CLS] / [SEP] never predicted
    assert torch.equal(labels[chosen], ids[chosen]) and torch.equal(inputs[~chosen], ids[~chosen])
    masked = (inputs == tok.mask_token_id) & chosen
    kept = (inputs == ids) & chosen
    assert 0.75 < masked.sum() / chosen.sum() < 0.85 and 0.06 < kept.sum() / chosen.sum() < 0.14
    # a row's mask depends on the seed and its own tokens only: the same in any batch, on any process
    sub_inputs, sub_labels = mask_tokens(ids[10:12], tok, seed=3)
    assert torch.equal(sub_inputs, inputs[10:12]) and torch.equal(sub_labels, labels[10:12])
    other, _ = mask_tokens(ids, tok, seed=4)
    assert not torch.equal(other, inputs)  # negative control: the seed matters
