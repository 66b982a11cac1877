"""Held-out means held out: `eval` on the file a model was fine-tuned on leaves the fine-tune's
training documents out by default, and says exactly what it evaluated (evaluate/heldout.py)."""

from __future__ import annotations

import itertools
import json

import pytest
from test_evaluate_fixtures import save_tiny


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """A tiny GPT-2 fine-tuned by normswap (2 steps) on a user's JSONL file of 300 verses."""
    from normswap.data import load_documents
    from normswap.finetune import FinetuneConfig, run_finetune

    root = tmp_path_factory.mktemp("heldout")
    my_text = root / "my_text.jsonl"
    verses = [
        line
        for doc in itertools.islice(load_documents("embedded", "train"), 40)
        for line in doc.splitlines()
        if line.strip()
    ]
    my_text.write_text("".join(json.dumps({"text": v}) + "\n" for v in verses[:300]))
    orig = save_tiny(root / "orig", seed=5)
    ft = root / "ft"
    run_finetune(
        FinetuneConfig(
            model=orig,
            out=str(ft),
            data=str(my_text),
            steps=2,
            seq_len=16,
            batch_size=2,
            eval_tokens=64,
            progress=False,
            device="cpu",
        )
    )
    return {"file": str(my_text), "orig": orig, "ft": str(ft), "docs": verses[:300]}


def _prepare(models, data, split=None):
    from normswap.evaluate.config import EvalConfig
    from normswap.evaluate.preflight import describe, prepare

    cfg = EvalConfig(split=split, speed=False, memory=False, diagnostics=False, seq_len=16)
    return prepare(describe(models), cfg, data=data, baseline_name=models[0][0])


def test_finetune_records_what_it_trained_on(finetuned):
    from pathlib import Path

    from normswap.checkpoint.manifest import read_manifest
    from normswap.data.sources import hash_split

    record = read_manifest(finetuned["ft"])["finetune"]["training_data"]
    trained = [d for d in finetuned["docs"] if hash_split(d) == "train"]
    assert record["path"] == str(Path(finetuned["file"]).resolve()) and record["split"] == "train"
    assert record["documents"] == len(trained) and record["characters"] == sum(map(len, trained))


def test_eval_on_the_finetune_file_leaves_its_training_documents_out(finetuned):
    from normswap.data.sources import hash_split

    prepared = _prepare([("orig", finetuned["orig"]), ("ft", finetuned["ft"])], finetuned["file"])
    d = prepared.data
    trained = [doc for doc in finetuned["docs"] if hash_split(doc) == "train"]
    test = [doc for doc in finetuned["docs"] if hash_split(doc) == "test"]
    assert d["split"] == "test" and d["held_out"] is True
    assert d["documents"] == len(test) and d["documents_available"] == len(finetuned["docs"])
    assert not any(doc in prepared.text for doc in trained)  # not one training document is scored
    assert d["caption"].startswith(
        f"my_text.jsonl, {len(test)} of {len(finetuned['docs'])} documents not seen in fine-tuning"
    )
    assert d["seen_in_finetune"] == [{"model": "ft", "split": "train", "documents": len(trained)}]


def test_negative_control_the_whole_file_includes_training_text_and_says_so(finetuned):
    from normswap.data.sources import hash_split

    # the old behaviour (all of the file): the training text is scored, and is no longer called held-out
    prepared = _prepare([("orig", finetuned["orig"]), ("ft", finetuned["ft"])], finetuned["file"], split="all")
    trained = [doc for doc in finetuned["docs"] if hash_split(doc) == "train"]
    assert sum(doc in prepared.text for doc in trained) == len(trained)
    assert prepared.data["held_out"] is False and "NOT held-out" in prepared.data["caption"]
    # a model normswap did not fine-tune on it: the user's file is read whole, as before
    plain = _prepare([("orig", finetuned["orig"])], finetuned["file"])
    assert (
        plain.data["split"] == "all"
        and plain.data["held_out"] is None
        and plain.data["documents"] == len(finetuned["docs"])
    )


def test_report_caption_says_what_was_evaluated(finetuned, tmp_path, run_cli):
    out = tmp_path / "rep"
    code, _, err = run_cli(
        "eval",
        "report",
        f"orig={finetuned['orig']}",
        f"ft={finetuned['ft']}",
        "--baseline",
        "orig",
        "--data",
        finetuned["file"],
        "--out",
        out,
        "--no-speed",
        "--no-memory",
        "--seq-len",
        "16",
    )
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    caption = results["data"]["caption"]
    assert "not seen in fine-tuning" in caption
    assert caption in (out / "report.md").read_text() and caption in (out / "report.html").read_text()
    assert "reading its test split, which fine-tuning never saw" in err


def test_perplexity_on_training_text_is_never_coloured():
    from normswap.report.render import headlines, table_rows

    def results(held):
        rows = [
            {"name": "orig", "kind": "original", "perplexity": 100.0, "ratios": None},
            {
                "name": "ft",
                "kind": "fine-tuned",
                "perplexity": 30.0,
                "ratios": {"perplexity": 0.3, "tokens_per_second": {}},
            },
        ]
        rows[0]["ratios"] = {"perplexity": 1.0, "tokens_per_second": {}}
        return {"baseline": "orig", "models": rows, "data": {"held_out": held}}

    card = headlines(results(False))[0]["items"][0]
    assert card[0] == "perplexity" and card[2] == "same" and card[3] == "not held-out text"
    header, rows = table_rows(results(False))
    assert rows[1][header.index("perplexity")][2] == "same"
    # control: the same numbers on held-out text are a measured gain
    assert headlines(results(True))[0]["items"][0][2] == "good"
    header, rows = table_rows(results(True))
    assert rows[1][header.index("perplexity")][2] == "good"
