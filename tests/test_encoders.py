"""Encoders end to end: eval report by fidelity, refusals, masking, healing.

Models are tiny real BertForMaskedLM / BertModel built from the bert family's test config, with a
WordPiece vocabulary trained here on the embedded corpus; conversion is the real approximate one.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from normswap.checkpoint.shards import SINGLE_NAME
from normswap.errors import NormswapError


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """{name: dir}: a masked-LM BERT and a bare BertModel, each with its approximate conversion."""
    from helpers import tiny_model, tiny_wordpiece

    from normswap.convert.pipeline import convert_checkpoint

    root = tmp_path_factory.mktemp("encoders")
    tok = tiny_wordpiece()
    dirs = {}
    for task, name in (("masked-lm", "mlm"), ("base", "enc")):
        src = root / name
        tiny_model("bert", task=task, randomize=False, seed=1).save_pretrained(src)
        tok.save_pretrained(src)
        convert_checkpoint(str(src), str(root / f"{name}-approx"), mode="approx", beta="drop", force=True)
        dirs[name], dirs[f"{name}-approx"] = src, root / f"{name}-approx"
    return dirs


# numbers compared with float32 tolerances are measured where those hold (auto is bf16 on CUDA)
PINNED = ("--device", "cpu", "--dtype", "float32")
QUICK_SPEED = (
    "--repeats",
    "1",
    "--warmup",
    "0",
    "--min-time",
    "0",
    "--seq-len",
    "32",
    "--batch-size",
    "2",
    "--max-tokens",
    "2048",
)


def test_eval_report_measures_encoders_by_fidelity(encoders, tmp_path, run_cli):
    out = tmp_path / "rep"
    code, stdout, err = run_cli(
        "eval",
        "report",
        f"orig={encoders['mlm']}",
        f"approx={encoders['mlm-approx']}",
        "--baseline",
        "orig",
        "--out",
        out,
        "--quiet",
        *QUICK_SPEED,
        *PINNED,
    )
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
    assert (
        rows["approx"]["tokens_per_second"]["train_step"] > 0 and "generate" not in rows["approx"]["tokens_per_second"]
    )
    md = (out / "report.md").read_text()
    assert "## Fidelity to orig" in md and (out / "fidelity.png").is_file()
    assert "embedding cosine (mean)" in stdout and "approx" in stdout


def test_bare_encoder_has_no_masked_metrics_and_mixed_kinds_are_refused(encoders, tmp_path, run_cli):
    out = tmp_path / "rep"
    code, _, err = run_cli(
        "eval",
        "report",
        str(encoders["enc"]),
        str(encoders["enc-approx"]),
        "--baseline",
        str(encoders["enc"]),
        "--out",
        out,
        "--quiet",
        "--no-speed",
        "--no-memory",
        "--seq-len",
        "32",
        "--max-tokens",
        "2048",
    )
    assert code == 0, err
    rows = json.loads((out / "results.json").read_text())["models"]
    assert [r["model_kind"] for r in rows] == ["encoder", "encoder"]
    assert rows[1]["fidelity"]["top1_agreement"] is None and rows[1]["fidelity"]["embedding_cosine"] < 1.0
    # an encoder and a causal LM have nothing in common to compare: one line, exit 2, nothing written
    code, _, err = run_cli(
        "eval", "report", "normswap:kjv-gpt2", str(encoders["mlm"]), "--out", tmp_path / "mixed", "--quiet"
    )
    assert code == 2 and "cannot compare causal LMs (kjv-gpt2) with encoders (mlm)" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "mixed" / "results.json").exists()
    code, _, err = run_cli("eval", "ppl", str(encoders["mlm"]), "--quiet")
    assert code == 2 and "perplexity is not defined for encoders" in err


def test_fidelity_reads_a_whole_user_file(encoders, tmp_path):
    """`eval` on a user's text file reads all of it (no hash split), verse-per-line included."""
    import normswap
    from normswap.data import default_eval_split, kjv
    from normswap.evaluate.config import EvalConfig
    from normswap.evaluate.side_by_side import ModelEntry, evaluate

    path = tmp_path / "heldout.txt"
    path.write_text("\n".join(list(kjv.verses("test"))[:60]) + "\n")
    entries = [
        ModelEntry(
            name=n,
            spec=str(encoders[n]),
            model=normswap.load_model(str(encoders[n]), task="auto"),
            tokenizer=normswap.load_tokenizer(str(encoders[n])),
        )
        for n in ("mlm", "mlm-approx")
    ]
    res = evaluate(
        entries,
        EvalConfig(split=default_eval_split(str(path)), seq_len=32, speed=False, memory=False),
        data=str(path),
        baseline_name="mlm",
    )
    assert res["data"]["split"] == "all" and res["data"]["words"] == len(path.read_text().split())  # every word read
    assert res["fidelity_setup"]["sentences"] >= 55


# ---------------------------------------------------------------- masking


def test_masking_is_bert_style_seeded_per_row_and_skips_special_tokens(encoders):
    import normswap
    from normswap.finetune.encoder_objectives import frame, mask_tokens

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


# ---------------------------------------------------------------- healing

CAUSAL_LOG_KEYS = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_second",
    "world_size",
    "tokens",
    "data_fingerprint",
    "epoch",
}
QUICK_FT = dict(batch_size=4, seq_len=32, eval_tokens=512, warmup_steps=2, lr=1e-3, device="cpu", progress=False)


def _finetune(model, out, hooks=None, **kw):
    from normswap.finetune import FinetuneConfig, run_finetune

    return run_finetune(FinetuneConfig(model=str(model), out=str(out), **{**QUICK_FT, **kw}), hooks=hooks)


def _hidden_cosine(model_dir, source_dir) -> float:
    import normswap
    from normswap.data import load_text
    from normswap.evaluate.fidelity import run_blocks, token_blocks

    tok = normswap.load_tokenizer(str(source_dir))
    ids = token_blocks(tok, load_text("embedded", "test")[:20000], 1024, 32)
    a = run_blocks(normswap.load_model(str(model_dir), task="auto"), ids)[0]
    b = run_blocks(normswap.load_model(str(source_dir), task="auto"), ids)[0]
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()


def test_distillation_heals_an_approximate_encoder_into_converts_format(encoders, tmp_path, run_cli):
    import normswap
    from normswap.finetune.run_dir import read_log_rows

    out = tmp_path / "healed"
    code, stdout, err = run_cli(
        "finetune",
        encoders["mlm-approx"],
        out,
        "--distill-from",
        encoders["mlm"],
        "--steps",
        "12",
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--eval-tokens",
        "512",
        "--warmup-steps",
        "2",
        "--lr",
        "1e-3",
        "--no-progress",
        "--device",
        "cpu",
        "--dtype",
        "float32",
    )
    assert code == 0, err
    rows = read_log_rows(out / "train_log.jsonl")
    assert [r["step"] for r in rows] == list(range(13))
    assert all(CAUSAL_LOG_KEYS <= set(r) for r in rows[1:])  # the same keys as a causal LM's log ...
    assert {"hidden_loss", "logit_kl"} <= set(rows[1])  # ... plus the objective's terms
    assert rows[-1]["eval_loss"] < 0.7 * rows[0]["eval_loss"] and rows[0]["eval_perplexity"] is None
    healed = normswap.load_model(str(out), task="auto")
    assert (
        any(c.__name__ == "BertForMaskedLM" for c in type(healed).__mro__)
        and healed.config.normswap["mode"] == "approx"
    )
    from normswap.checkpoint.manifest import read_manifest

    assert read_manifest(str(out))["finetune"]["distill_from"] == str(encoders["mlm"])
    # what a user cares about: closer to the source than the conversion was (the approximate
    # conversion itself is the negative control)
    healed_gap = 1 - _hidden_cosine(out, encoders["mlm"])
    approx_gap = 1 - _hidden_cosine(encoders["mlm-approx"], encoders["mlm"])
    assert healed_gap < 0.7 * approx_gap, (healed_gap, approx_gap)


def test_distillation_trains_without_dropout_on_hidden_states_and_pooled_directions(encoders, tmp_path):
    """The student's loss is a deterministic function of its weights (dropout off: the teacher is
    deterministic, so dropout noise would swamp the small remaining error), and its terms measure
    what they claim: the pooled-span term only the direction of mean-pooled spans."""
    import normswap
    from normswap.finetune import FinetuneConfig
    from normswap.finetune.encoder_objectives import (
        Encoder,
        frame,
        hidden_state_loss,
        pooled_cosine_loss,
        token_cosine_loss,
    )

    cfg = FinetuneConfig(model=str(encoders["mlm-approx"]), out=str(tmp_path / "o"), distill_from=str(encoders["mlm"]))
    student = normswap.load_model(str(encoders["mlm-approx"]), task="auto")
    teacher = normswap.load_model(str(encoders["mlm"]), task="auto")
    control = normswap.load_model(str(encoders["mlm-approx"]), task="auto").train()
    ids = torch.randint(5, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    # negative control: as loaded, a model in training mode is noisy (dropout)
    assert not torch.equal(control(input_ids=ids).logits, control(input_ids=ids).logits)
    objective = Encoder.build(cfg, student, teacher)
    student.train()
    a, b = objective.loss(student, ids), objective.loss(student, ids)
    assert torch.equal(a.total, b.total) and {
        "hidden_loss",
        "token_cosine_loss",
        "pooled_cosine_loss",
        "logit_kl",
    } <= set(a.parts)
    assert a.total.item() == pytest.approx(
        sum(a.parts[k].item() for k in ("hidden_loss", "token_cosine_loss", "pooled_cosine_loss", "logit_kl")), rel=1e-5
    )

    with torch.no_grad():
        h = teacher(input_ids=frame(ids, objective.tokenizer), output_hidden_states=True).hidden_states
    last = h[-1]
    assert pooled_cosine_loss(last, last).abs() < 1e-6 and token_cosine_loss(last, last).abs() < 1e-6
    # direction only: a scaled copy costs nothing here but does in the squared error ...
    assert pooled_cosine_loss(3 * last, last).abs() < 1e-5 and hidden_state_loss([3 * last], [last], "final") > 1
    # ... and one span (16 tokens) turned around is found
    flipped = last.clone()
    flipped[0, 16:32] *= -1
    assert pooled_cosine_loss(flipped, last).item() == pytest.approx(2 / 6, rel=1e-4)  # 1 of 2 × 3 spans at cosine −1


def test_bare_encoder_heals_only_with_a_teacher(encoders, tmp_path):
    from normswap.finetune.run_dir import read_log_rows

    with pytest.raises(NormswapError, match="without a masked-LM head.*--distill-from") as e:
        _finetune(encoders["enc-approx"], tmp_path / "no-teacher", steps=2)
    assert "\n" not in str(e.value) and not (tmp_path / "no-teacher").exists()
    s = _finetune(
        encoders["enc-approx"],
        tmp_path / "final-only",
        steps=3,
        distill_from=str(encoders["enc"]),
        distill_layers="final",
    )
    rows = read_log_rows(tmp_path / "final-only" / "train_log.jsonl")
    assert "hidden_loss" in rows[1] and "logit_kl" not in rows[1]  # no head: hidden states only
    assert s["final_eval_loss"] < s["initial_eval_loss"]


def test_masked_lm_objective_trains_and_resumes_on_the_same_trajectory(encoders, tmp_path):
    """No teacher: the masked-LM loss; a run that crashes after a checkpoint and resumes ends with
    the same weights and losses as one that never stopped (masks come from seeded per-row generators)."""
    from safetensors.torch import load_file

    from normswap.finetune.run_dir import read_log_rows
    from normswap.testing import FinetuneHooks as Hooks

    straight = tmp_path / "straight"
    s = _finetune(encoders["mlm-approx"], straight, steps=4, save_every=2)
    assert s["initial_perplexity"] == pytest.approx(math.exp(s["initial_eval_loss"]))  # masked-token perplexity
    assert s["final_eval_loss"] < s["initial_eval_loss"]

    def crash(step):
        if step == 3:
            raise RuntimeError("simulated crash")

    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        _finetune(encoders["mlm-approx"], crashed, steps=4, save_every=2, hooks=Hooks(after_step=crash))
    _finetune(encoders["mlm-approx"], crashed, steps=4, save_every=2, resume=True)
    a, b = load_file(straight / SINGLE_NAME), load_file(crashed / SINGLE_NAME)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    la, lb = read_log_rows(straight / "train_log.jsonl"), read_log_rows(crashed / "train_log.jsonl")
    assert [r["loss"] for r in la] == [r["loss"] for r in lb]
    # negative control: another seed draws other masks, so another trajectory
    other = _finetune(encoders["mlm-approx"], tmp_path / "seed1", steps=4, seed=1)
    assert other["final_train_loss"] != s["final_train_loss"]


def test_eval_data_names_the_held_out_set(encoders, tmp_path):
    """A verse-per-line training file with a separately named held-out file."""
    from normswap.data import kjv

    train, held = tmp_path / "train.txt", tmp_path / "held.txt"
    train.write_text("\n".join(list(kjv.verses("train"))[:400]) + "\n")
    held.write_text("\n".join(list(kjv.verses("test"))[:40]) + "\n")
    s = _finetune(
        encoders["mlm-approx"], tmp_path / "out", steps=2, data=str(train), eval_data=str(held), eval_tokens=256
    )
    assert s["eval_tokens"] == 256 and s["final_eval_loss"] > 0
    import json as _json

    assert _json.loads((tmp_path / "out" / "finetune_run.json").read_text())["config"]["eval_data"] == str(held)


@pytest.mark.slow
def test_encoder_recipe_converts_heals_and_reports_offline(encoders, tmp_path, run_cli):
    """The shipped all-minilm-l6-v2 recipe's pipeline, on the tiny BertModel instead of the hub model."""
    out = tmp_path / "run"
    ft = "variants.approx.finetune."
    code, stdout, err = run_cli(
        "run",
        "all-minilm-l6-v2",
        "--out",
        out,
        "--set",
        f"source={encoders['enc']}",
        "--set",
        "needs_network=false",
        "--set",
        f"{ft}steps=8",
        "--set",
        f"{ft}batch_size=4",
        "--set",
        f"{ft}seq_len=32",
        "--set",
        f"{ft}lr=0.001",
        "--set",
        f"{ft}warmup_steps=2",
        "--set",
        f"{ft}eval_tokens=256",
        "--set",
        "eval.seq_len=32",
        "--set",
        "eval.fidelity_tokens=1024",
        "--set",
        "eval.speed=false",
        "--set",
        "eval.memory=false",
        "--set",
        "device=cpu",
    )  # pinned: float32 tolerances below
    assert code == 0, err
    results = json.loads((out / "report" / "results.json").read_text())
    fid = {m["name"]: m["fidelity"] for m in results["models"]}
    assert list(fid) == ["original", "approx", "approx-healed"]
    assert fid["original"]["embedding_cosine"] == pytest.approx(1.0, abs=1e-6)
    # healing moved the conversion toward the original (the unhealed conversion is the control)
    assert fid["approx-healed"]["hidden_cosine"] > fid["approx"]["hidden_cosine"]
    assert fid["approx-healed"]["embedding_cosine"] < 1.0 and fid["approx-healed"]["sentences"] >= 100
    assert "embedding cosine" in stdout and (out / "report" / "fidelity.png").is_file()


def test_convert_drops_a_stored_buffer_that_is_no_longer_persistent(encoders, tmp_path):
    """Older BERT checkpoints (all-MiniLM-L6-v2's among them) store embeddings.position_ids, a
    buffer transformers no longer saves: convert drops it like from_pretrained; a tensor with no
    place in the model at all is still refused (the control)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from normswap.convert.pipeline import convert_checkpoint

    def with_extra(name, key):
        src = tmp_path / name
        shutil.copytree(encoders["enc"], src)
        sd = load_file(src / "model.safetensors")
        sd[key] = torch.arange(512, dtype=torch.int64).unsqueeze(0)
        save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
        return src

    convert_checkpoint(
        str(with_extra("old", "embeddings.position_ids")), str(tmp_path / "old-approx"), mode="approx", force=True
    )
    assert (tmp_path / "old-approx" / "config.json").is_file()
    with pytest.raises(NormswapError, match="no place in the BertModel.*embeddings.stray"):
        convert_checkpoint(
            str(with_extra("stray", "embeddings.stray")), str(tmp_path / "stray-approx"), mode="approx", force=True
        )
    assert not (tmp_path / "stray-approx").exists()
