"""`normswap finetune`: healing, schedule, resume after a kill, divergence guard, distillation,
norms-only training and two-process (torchrun, gloo) runs — all on a small GPT-2 trained here on
the embedded corpus for a few seconds."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import checked_run

REPO = Path(__file__).resolve().parents[1]
SEQ = 32
# Numbers below are compared with references computed on the CPU in float32: the runs are pinned
# to the CPU too (test_cuda_run_matches_its_own_device_reference covers a GPU when there is one).
COMMON = dict(data="embedded", seq_len=SEQ, batch_size=4, eval_tokens=1024, progress=False, device="cpu")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Two shared cores: one thread per process is several times faster than two fighting threads,
    # and the subprocess runs below use one thread too, so their arithmetic matches in-process runs.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CI", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


MODEL_NAMES = ("source", "approx", "exact")


@pytest.fixture(scope="module")
def models(built_once):
    """A small trained LayerNorm GPT-2 (source) and its approximate (β dropped, γ kept) and exact
    conversions, as checkpoint directories: trained once per test run, whichever xdist worker
    asks first (tests/conftest.py built_once); no test writes into them."""
    root = built_once("finetune-models", _train_and_convert)
    return {name: root / name for name in MODEL_NAMES}


def _train_and_convert(root):
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tmodels
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    import normswap
    from normswap.checkpoint.write import save_checkpoint
    from normswap.convert import convert_model
    from normswap.data import load_documents, pack_tokens

    torch.set_num_threads(1)  # the numbers of a one-thread run, whichever module's worker builds it
    tk = Tokenizer(tmodels.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(itertools.islice(load_documents("embedded", "train"), 300), trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|endoftext|>", bos_token="<|endoftext|>", unk_token="<|endoftext|>"
    )

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=len(tok),
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = GPT2LMHeadModel(cfg)
    # A few seconds of training leave β near its zero init, unlike any real checkpoint (GPT-2's β
    # are O(0.1-1)); starting β away from zero gives the tiny model the reliance on β that makes
    # dropping it cost something, as it does for real models.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.bias.normal_(0, 0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    blocks = pack_tokens(tok, load_documents("embedded", "train"), 64)
    model.train()
    for _ in range(120):
        batch = torch.stack(list(itertools.islice(blocks, 8)))
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    src = root / "source"
    model.save_pretrained(src)
    tok.save_pretrained(src)

    for name, kw in {"approx": dict(mode="approx", gamma="keep", beta="drop"), "exact": dict(mode="exact")}.items():
        m = normswap.load_model(src)
        convert_model(m, **kw)
        save_checkpoint(m, root / name, tokenizer=tok)


def _eval_set(path):
    import normswap
    from normswap.finetune import eval_blocks

    return eval_blocks(normswap.load_tokenizer(path), "embedded", SEQ, COMMON["eval_tokens"])


def _eval_set_of(path, tokens):
    import normswap
    from normswap.finetune import eval_blocks

    return eval_blocks(normswap.load_tokenizer(path), "embedded", SEQ, tokens)


def _loss_of(path) -> float:
    import normswap
    from normswap.finetune import heldout_loss

    return heldout_loss(normswap.load_model(path, task="causal-lm"), _eval_set(path))


def _log(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "train_log.jsonl").read_text().splitlines() if line.strip()]


def _weights(out) -> dict:
    from safetensors.torch import load_file

    files = sorted(Path(out).glob("*.safetensors"))
    assert files, f"no weights in {out}"
    sd = {}
    for f in files:
        sd.update(load_file(f))
    return sd


def _run(model, out, *, hooks=None, echo=None, **kw):
    from normswap.finetune import FinetuneConfig, run_finetune

    return run_finetune(FinetuneConfig(model=str(model), out=str(out), **{**COMMON, **kw}), hooks=hooks, echo=echo)


def _nan_at(step):
    """Fault injection: the loss of ``step`` becomes NaN (the real divergence guard then acts)."""
    from normswap.testing import FinetuneHooks as Hooks

    return Hooks(loss=lambda s, loss: loss * float("nan") if s == step else loss)


# ---------------------------------------------------------------------------------------------


def test_schedule_is_linear_warmup_then_decay():
    from normswap.finetune import lr_factor

    kw = dict(total_steps=20, warmup_steps=5)
    # η_t = η_max·min(t/T_w, 1) with 1-based steps: the first update already moves, step T_w is full
    assert [lr_factor(t, schedule="cosine", **kw) for t in range(1, 6)] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert lr_factor(20, schedule="cosine", min_ratio=0.1, **kw) == pytest.approx(0.1)
    assert lr_factor(20, schedule="linear", **kw) == pytest.approx(0.0)
    assert lr_factor(12, total_steps=20, warmup_steps=4, schedule="linear") == pytest.approx(0.5)
    assert all(lr_factor(t, schedule="constant", **kw) == 1.0 for t in range(5, 21))
    # cosine decays monotonically after the warmup
    vals = [lr_factor(t, schedule="cosine", **kw) for t in range(5, 21)]
    assert all(a >= b for a, b in zip(vals, vals[1:])) and vals[0] > vals[-1]
    assert lr_factor(1, total_steps=3, warmup_steps=0, schedule="constant") == 1.0


def test_approx_conversion_hurts_and_short_finetune_heals_it(models, tmp_path):
    src_loss = _loss_of(models["source"])
    approx_loss = _loss_of(models["approx"])
    assert approx_loss > src_loss + 0.03, (src_loss, approx_loss)  # β dropped: the conversion costs something

    steps, warm, lr = 30, 5, 2e-3
    s = _run(models["approx"], tmp_path / "healed", steps=steps, lr=lr, warmup_steps=warm, schedule="cosine", seed=0)
    rows = _log(tmp_path / "healed")
    # step 0 is the held-out loss before any update, computed on the same held-out set
    assert rows[0]["step"] == 0 and rows[0]["eval_loss"] == pytest.approx(approx_loss, abs=1e-6)
    assert [r["step"] for r in rows] == list(range(steps + 1))
    for r in rows[1:]:
        assert {"loss", "lr", "grad_norm", "tokens_per_second", "world_size"} <= set(r) and r["world_size"] == 1
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["tokens_per_second"] > 0
    # the warmup follows η_t = η_max·min(t/T_w, 1) step by step, then the cosine decay
    for r in rows[1 : warm + 1]:
        assert r["lr"] == pytest.approx(lr * r["step"] / warm, rel=1e-12)
    after = [r["lr"] for r in rows[warm:]]
    assert all(a >= b for a, b in zip(after, after[1:])) and after[-1] < 0.2 * lr

    gap_before = approx_loss - src_loss
    gap_after = s["final_eval_loss"] - src_loss
    assert gap_after < 0.5 * gap_before, (src_loss, approx_loss, s["final_eval_loss"])
    assert rows[-1]["eval_loss"] == pytest.approx(s["final_eval_loss"])
    # the healed model on disk is the one that was measured
    assert _loss_of(tmp_path / "healed") == pytest.approx(s["final_eval_loss"], abs=1e-5)

    # negative control: with a negligible learning rate nothing heals (the gain above is training)
    s0 = _run(models["approx"], tmp_path / "lr-tiny", steps=3, lr=1e-12, warmup_steps=0, seed=0)
    assert s0["final_eval_loss"] == pytest.approx(approx_loss, abs=1e-6)


def test_exact_conversion_starts_at_the_source_loss_and_output_reloads(models, tmp_path):
    from transformers import AutoModelForCausalLM

    import normswap
    from normswap.checkpoint.manifest import read_manifest

    src_loss = _loss_of(models["source"])
    out = tmp_path / "ft"
    s = _run(models["exact"], out, steps=2, lr=1e-3, warmup_steps=1, seed=3)
    assert s["initial_eval_loss"] == pytest.approx(src_loss, abs=1e-5)
    assert _log(out)[0]["eval_loss"] == pytest.approx(src_loss, abs=1e-5)
    # negative control: the approximate conversion does not start there
    assert abs(_loss_of(models["approx"]) - src_loss) > 1e-3

    # the output is convert's format: stock transformers (remote code) and normswap load it alike
    ids = _eval_set(out)[:2]
    a = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    b = normswap.load_model(out, task="causal-lm")
    with torch.no_grad():
        assert torch.allclose(a(input_ids=ids).logits, b(input_ids=ids).logits, atol=1e-6)
    assert any(type(m).__name__ == "RMSNorm" for m in a.modules())
    assert "normswap" in json.loads((out / "config.json").read_text())
    before, after = _weights(models["exact"]), _weights(out)
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)  # it trained
    man = read_manifest(out)
    ft = man["finetune"]
    assert ft["steps"] == 2 and ft["lr"] == 1e-3 and ft["seed"] == 3 and ft["world_size"] == 1
    assert ft["final_metrics"]["final_eval_loss"] == pytest.approx(s["final_eval_loss"])
    assert not (out / "checkpoints").exists()  # resumable state is dropped once the final model is written


def _logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.double(), dim=-1)


def test_exact_conversion_stays_exportable_as_stock_and_no_keep_centred_is_refused(models, tmp_path):
    """convert → finetune → export --format stock (the README's order): the fine-tune projects the
    stream writers back to zero mean after each step, so the export loads in plain transformers and
    equals the fine-tuned model; without the projection export refuses in one line, naming onnx."""
    from transformers import AutoModelForCausalLM

    import normswap
    from normswap.checkpoint.manifest import read_manifest
    from normswap.errors import NormswapError
    from normswap.export import run_export

    record = json.loads((models["exact"] / "config.json").read_text())["normswap"]["stream_writers"]
    assert any(".c_proj.weight" in k for k in record["zero_mean"]) and "transformer.wpe.weight" in record["zero_mean"]
    kept, free = tmp_path / "kept", tmp_path / "free"
    # a large learning rate: a few steps move the writers far off zero mean unless projected back
    _run(models["exact"], kept, steps=3, lr=1e-2, warmup_steps=0)
    _run(models["exact"], free, steps=3, lr=1e-2, warmup_steps=0, keep_centred=False)
    assert read_manifest(kept)["finetune"]["keep_centred"] is True
    assert read_manifest(kept)["finetune"]["kept_centred"]["zero_mean_tensors"] == len(record["zero_mean"])
    assert read_manifest(free)["finetune"]["keep_centred"] is False
    assert read_manifest(free)["finetune"]["kept_centred"] is None
    wk, wf = _weights(kept), _weights(free)
    key = "transformer.h.0.mlp.c_proj.weight"  # Conv1D [in, out]: the output axis is the last
    assert float(wk[key].double().mean(-1).abs().max()) < 1e-6
    assert float(wf[key].double().mean(-1).abs().max()) > 1e-4  # negative control: it does drift

    record = run_export(kept, tmp_path / "kept-stock", "stock")
    assert record["verification"]["passed"]
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "kept-stock").eval()  # plain transformers
    assert not any(type(m).__name__ == "RMSNorm" for m in stock.modules())
    tuned = normswap.load_model(kept, task="causal-lm").eval()
    ids = _eval_set(kept)[:2]
    assert float((_logprobs(stock, ids) - _logprobs(tuned, ids)).abs().max()) <= 1e-4

    with pytest.raises(NormswapError) as e:
        run_export(free, tmp_path / "free-stock", "stock")
    msg = str(e.value)
    assert "\n" not in msg and "no longer zero-mean" in msg and "--no-keep-centred" in msg
    assert "--format onnx" in msg
    assert not (tmp_path / "free-stock").exists()


def test_norms_only_trains_just_the_norms_and_refuses_folded_norms(models, tmp_path):
    from normswap.errors import NormswapError

    out = tmp_path / "norms"
    s = _run(models["approx"], out, steps=3, lr=1e-2, warmup_steps=0, trainable="norms", weight_decay=0.1)
    before, after = _weights(models["approx"]), _weights(out)
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    norm_keys = sorted(k for k in before if ".ln_" in k and k.endswith(".weight"))
    assert changed == norm_keys and len(norm_keys) == 5, changed
    assert s["trainable_parameters"] == 5 * 64
    # exact conversion folded γ into the next layers: "norms" has nothing meaningful to train
    with pytest.raises(NormswapError, match="no γ.*--trainable all"):
        _run(models["exact"], tmp_path / "refused", steps=1, trainable="norms")
    assert not (tmp_path / "refused").exists()


def test_distillation_toward_the_source(models, tmp_path):
    from normswap.finetune.losses import distill_loss

    torch.manual_seed(0)
    x = torch.randn(2, 5, 11)
    assert float(distill_loss(x, x.clone(), 2.0)) == pytest.approx(0.0, abs=1e-6)  # identical distributions
    assert float(distill_loss(x, torch.randn(2, 5, 11))) > 0.1

    out = tmp_path / "kd"
    s = _run(
        models["approx"], out, steps=12, lr=2e-3, warmup_steps=2, distill_from=str(models["source"]), distill_alpha=1.0
    )
    rows = _log(out)[1:]
    assert all(r["loss"] == pytest.approx(r["distill_loss"]) for r in rows)  # α = 1: pure KL
    assert rows[0]["distill_loss"] > 0.02
    assert rows[-1]["distill_loss"] < 0.5 * rows[0]["distill_loss"]
    assert s["final_eval_loss"] < s["initial_eval_loss"]


def test_refusals(models, tmp_path):
    from normswap.errors import NormswapError

    out = tmp_path / "exists"
    out.mkdir()
    with pytest.raises(NormswapError, match="exists: pass --resume .* or --force"):
        _run(models["approx"], out, steps=1)
    with pytest.raises(NormswapError, match="overlaps the model .*, which this command reads"):
        _run(models["approx"], models["approx"], steps=1, force=True)
    assert (models["approx"] / "config.json").exists()
    with pytest.raises(NormswapError, match="divisible"):
        _run(models["approx"], tmp_path / "x", steps=1, batch_size=3, grad_accum=2)
    with pytest.raises(NormswapError, match="not a normswap finetune run"):
        _run(models["approx"], out, steps=1, resume=True)


def test_grad_accum_gives_the_same_step_as_one_big_batch(models, tmp_path):
    a = _run(models["approx"], tmp_path / "a", steps=2, lr=1e-3, warmup_steps=0, grad_accum=1)
    b = _run(models["approx"], tmp_path / "b", steps=2, lr=1e-3, warmup_steps=0, grad_accum=4)
    la, lb = _log(tmp_path / "a"), _log(tmp_path / "b")
    for ra, rb in zip(la[1:], lb[1:]):
        assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-5)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)
    assert a["final_eval_loss"] == pytest.approx(b["final_eval_loss"], abs=1e-5)


def test_nan_guard_stops_keeps_last_checkpoint_and_a_lower_lr_resumes(models, tmp_path, capsys):
    from normswap.cli.main import main
    from normswap.finetune import TrainingDiverged
    from normswap.finetune.config import RUN_FILE

    out = tmp_path / "nan"
    with pytest.raises(TrainingDiverged) as e:
        _run(models["approx"], out, steps=6, save_every=2, lr=1e-3, warmup_steps=1, hooks=_nan_at(3))
    msg = str(e.value)
    assert (
        "loss is nan at step 3" in msg and "step-2" in msg and f"normswap finetune {out} --resume --lr 0.0001" in msg
    ), msg
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
    assert not (out / "config.json").exists()  # no final model from a diverged run
    assert [r["step"] for r in _log(out)] == [0, 1, 2]

    # --resume takes the recorded options: none is retyped; raising --lr is refused, and every
    # mismatch is named in one message
    def cli(*args):
        capsys.readouterr()  # what earlier in-process runs printed
        try:
            main(["finetune", *map(str, args)])
            code = 0
        except SystemExit as e:
            code = e.code
        return code, capsys.readouterr().err.strip().splitlines()

    code, err = cli(out, "--resume", "--lr", "2e-3", "--seed", "9", "--seq-len", "16", "--eval-tokens", "512")
    assert code == 2 and len(err) == 1, err
    for part in (
        "--lr is 0.002 but the run used 0.001 (it may only be lowered)",
        "--seed is 9 but the run used 0",
        "--seq-len is 16 but the run used 32",
        "--eval-tokens is 512 but the run used 1024",
    ):
        assert part in err[0], err
    assert [r["step"] for r in _log(out)] == [0, 1, 2]  # a refused resume changes nothing

    # the advice works: --resume with a lower --lr continues from the kept checkpoint
    code, err = cli(out, "--resume", "--lr", "1e-4", "--device", "cpu", "--no-progress")
    assert code == 0, err
    assert any(f"resuming from {out / 'checkpoints' / 'step-2'} (step 2/6)" in line for line in err), err
    rows = _log(out)
    assert [r["step"] for r in rows] == list(range(7))
    from normswap.finetune import lr_factor

    for r in rows[1:]:  # the schedule's shape is kept; from step 3 on it scales the lower peak
        peak = 1e-3 if r["step"] <= 2 else 1e-4
        assert r["lr"] == pytest.approx(
            peak * lr_factor(r["step"], total_steps=6, warmup_steps=1, schedule="cosine", min_ratio=0.1), rel=1e-12
        )
    run = json.loads((out / RUN_FILE).read_text())
    assert run["status"] == "finished" and run["config"]["lr"] == 1e-4
    assert run["resumes"] == [{"from_step": 2, "overrides": {"lr": [1e-3, 1e-4]}}]
    from normswap.checkpoint.manifest import read_manifest

    assert read_manifest(out)["finetune"]["resumes"] == run["resumes"] and read_manifest(out)["finetune"]["lr"] == 1e-4
    # held-out losses of the resumed run are on the recorded held-out set (1024 tokens here)
    assert run["summary"]["eval_tokens"] == 1024 and run["summary"]["initial_eval_loss"] == rows[0]["eval_loss"]
    code, err = cli(out, "--resume")
    assert code == 2 and "already holds a finished fine-tune" in err[0]


def test_exploded_weights_are_never_kept_and_the_error_is_one_line(models, tmp_path, capsys):
    from normswap.cli.main import main

    out = tmp_path / "boom"
    with pytest.raises(SystemExit) as e:
        main(
            [
                "finetune",
                str(models["approx"]),
                str(out),
                "--steps",
                "4",
                "--save-every",
                "1",
                "--seq-len",
                str(SEQ),
                "--batch-size",
                "4",
                "--eval-tokens",
                "256",
                "--lr",
                "1e9",
                "--warmup-steps",
                "0",
                "--device",
                "cpu",
            ]
        )
    assert e.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    # finetune's header (what it trains, the data's sizes) comes first; the failure is one error line
    err = [line for line in lines if "error" in line.lower() or "not sane" in line]
    assert "Traceback" not in "\n".join(lines), lines
    assert len(err) == 1 and "weights are not sane" in err[0] and "exploded" in err[0], lines
    assert "last good checkpoint: none" in err[0] and "--force" in err[0]
    assert not any(
        p.name.startswith("step-") for p in (out / "checkpoints").iterdir()
    )  # the exploded state was not kept
    assert not (out / "config.json").exists()


def test_resume_options_and_refusals(models, tmp_path, capsys):
    from normswap.cli.main import main

    def cli(*args):
        capsys.readouterr()
        try:
            main(["finetune", *map(str, args)])
            code = 0
        except SystemExit as e:
            code = e.code
        return code, capsys.readouterr().err.strip()

    code, err = cli(tmp_path / "nothing", "--resume")
    assert code == 2 and "cannot resume" in err and "does not exist" in err
    assert not (tmp_path / "nothing").exists()
    code, err = cli(models["approx"], tmp_path / "zero", "--lr", "0")
    assert code == 2 and "--lr must be > 0, got 0.0" in err and not (tmp_path / "zero").exists()
    code, err = cli(models["approx"])
    assert code == 2 and "missing OUT" in err


def test_resumed_progress_counts_to_the_recorded_target_from_the_resumed_step(models, tmp_path):
    """The command line of `finetune OUT --resume` says no --steps (its default, 200, is a guess):
    the progress lines must count to the run's recorded target, and the time left must come from
    the steps this process ran."""
    import shutil

    from normswap.finetune import FinetuneConfig, run_finetune
    from normswap.finetune.run_dir import RunDir
    from normswap.finetune.trainer import Hooks, TrainingDiverged
    from normswap.progress import StepProgress

    out = tmp_path / "resumed"
    with pytest.raises(TrainingDiverged):  # stops at step 5; the step-4 checkpoint is kept
        _run(models["approx"], out, steps=6, save_every=2, lr=1e-3, warmup_steps=0, hooks=_nan_at(5))

    def resume(out, with_started: bool) -> list[str]:
        now, lines = [0.0], []

        def clock():
            now[0] += 1.0  # every reading is one second later
            return now[0]

        progress = StepProgress(RunDir(out), FinetuneConfig.steps, lambda line: lines.append(line()), clock=clock)
        cfg = FinetuneConfig(model=None, out=str(out), resume=True, progress=False, device="cpu")
        hooks = Hooks(after_step=progress, started=progress.start if with_started else None)
        run_finetune(cfg, given=set(), hooks=hooks, echo=lambda m: None)
        return lines

    control = tmp_path / "control"
    shutil.copytree(out, control)
    lines = resume(out, True)
    assert [line.split()[1] for line in lines] == ["5/6", "6/6"], lines
    assert lines[0].endswith("(1 s, ~1 s left)") and lines[1].endswith("(2 s, ~0 s left)"), lines
    # negative control: without the trainer's word the line counts to the command line's default
    assert resume(control, False)[0].startswith("step 5/200")


def test_a_finished_run_trains_further_with_resume_and_more_steps(models, tmp_path):
    from normswap.checkpoint.manifest import read_manifest
    from normswap.errors import NormswapError
    from normswap.finetune import FinetuneConfig, lr_factor, run_finetune

    out = tmp_path / "extended"
    _run(models["approx"], out, steps=20, lr=1e-3, warmup_steps=2)
    before = _log(out)
    assert before[-1]["step"] == 20 and not (out / "checkpoints").exists()

    def resume(**kw):
        cfg = FinetuneConfig(model=None, out=str(out), resume=True, progress=False, device="cpu", **kw)
        return run_finetune(cfg, given=set(kw), echo=lambda m: None)

    # negative control: --resume alone (or the same --steps) on a finished run is refused, with the way out
    for kw in ({}, {"steps": 20}):
        with pytest.raises(NormswapError, match=r"finished fine-tune of 20 steps: .*--resume --steps N"):
            resume(**kw)
    s = resume(steps=30)
    after = _log(out)
    assert [r["step"] for r in after] == list(range(31)) and s["steps"] == 30 and s["resumed_from_step"] == 20
    assert after[:21] == before  # the first 20 steps are the finished run's, untouched
    # the schedule continues as the one of the new total (cosine over 30 steps)
    for r in after[21:]:
        assert r["lr"] == pytest.approx(
            1e-3 * lr_factor(r["step"], total_steps=30, warmup_steps=2, schedule="cosine", min_ratio=0.1)
        )
    # it trained on from the final model (not from the source): the first new loss is near the last one
    assert abs(after[21]["loss"] - before[-1]["loss"]) < abs(before[1]["loss"] - before[-1]["loss"])
    run = json.loads((out / "finetune_run.json").read_text())
    assert run["status"] == "finished" and run["config"]["steps"] == 30
    assert run["resumes"][-1] == {"from_step": 20, "overrides": {"steps": [20, 30]}}
    assert read_manifest(out)["finetune"]["steps"] == 30
    assert not (out / "checkpoints").exists()


def test_short_runs_evaluate_on_held_out_text_sized_to_the_run(models, tmp_path):
    from normswap.finetune.config import EVAL_TOKENS_MAX, default_eval_tokens

    assert default_eval_tokens(200, 8, 512) == EVAL_TOKENS_MAX  # a default-length run: the full held-out set
    assert default_eval_tokens(3, 8, 512) == 8 * 512  # `--steps 3`: 4,096 tokens, not 65,536
    s = _run(models["approx"], tmp_path / "short", steps=1, lr=1e-4, warmup_steps=0, eval_tokens=None)
    assert s["eval_tokens"] == 8 * SEQ
    want = _eval_set_of(models["approx"], 8 * SEQ)
    import normswap
    from normswap.finetune import heldout_loss

    assert s["initial_eval_loss"] == pytest.approx(
        heldout_loss(normswap.load_model(models["approx"], task="causal-lm"), want), abs=1e-6
    )
    # negative control: the default-sized set is not the explicit 1,024-token one the other tests use
    assert s["initial_eval_loss"] != pytest.approx(_loss_of(models["approx"]), abs=1e-6)


def test_context_check_knows_every_family_key(tmp_path):
    from transformers import MptConfig

    from normswap.errors import NormswapError

    mpt = tmp_path / "mpt"
    MptConfig(d_model=32, n_heads=2, n_layers=1, max_seq_len=16, vocab_size=64).save_pretrained(mpt)
    with pytest.raises(NormswapError, match="--seq-len 32 is longer than the model's context \\(16\\)"):
        _run(mpt, tmp_path / "out", steps=1)
    assert not (tmp_path / "out").exists()


def test_options_are_declared_once(tmp_path):
    import dataclasses

    from normswap.cli.finetune_command import finetune
    from normswap.errors import NormswapError
    from normswap.finetune.config import FinetuneConfig
    from normswap.recipes.schema import FINETUNE, validate

    fields = {f.name: f for f in dataclasses.fields(FinetuneConfig)}
    parsed = finetune.make_context("finetune", ["MODEL", "OUT"]).params  # what the CLI passes when nothing is typed
    for name, f in fields.items():
        if f.metadata["cli"]:
            assert parsed[name] == f.default, name  # the CLI's defaults are the dataclass'
        if f.metadata["recipe"]:
            assert FINETUNE[name].default == f.default, name
    assert set(FINETUNE) == {n for n, f in fields.items() if f.metadata["recipe"]} and "lr" in FINETUNE
    # the recipe validation is the finetune validation: lr 0 and a bad ratio are refused there too
    raw = {"name": "x", "source": "s", "variants": {"a": {"finetune": {"lr": 0}}}}
    with pytest.raises(NormswapError, match="variants.a.finetune.lr: must be > 0"):
        validate(raw, "x.yaml")
    raw["variants"]["a"]["finetune"] = {"lr": 1e-3, "min_lr_ratio": 2}
    with pytest.raises(NormswapError, match="variants.a.finetune.min_lr_ratio: must be <= 1"):
        validate(raw, "x.yaml")
    raw["variants"]["a"]["finetune"] = {"lr": 1e-3}
    assert validate(raw, "x.yaml")["variants"]["a"]["finetune"]["eval_tokens"] is None  # sized to the run


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_run_matches_its_own_device_reference(models, tmp_path):
    import normswap
    from normswap.finetune import heldout_loss

    out = tmp_path / "cuda"
    s = _run(
        models["approx"],
        out,
        steps=4,
        save_every=2,
        lr=1e-3,
        warmup_steps=1,
        device="cuda",
        dtype="float32",
        keep_checkpoints_after_finish=True,
    )
    reference = heldout_loss(
        normswap.load_model(models["approx"], task="causal-lm", device="cuda"), _eval_set(models["approx"])
    )
    assert s["initial_eval_loss"] == pytest.approx(reference, abs=1e-5)  # same device, same numbers
    assert s["final_eval_loss"] < s["initial_eval_loss"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]


# --- kill / interrupt and resume: real processes ----------------------------------------------

RESUME_ARGS = dict(steps=9, save_every=3, lr=2e-3, warmup_steps=2, seed=7)

# The kill tests run the real CLI in a child process that stops itself after the step-3 checkpoint
# (a hook passed from here, not anything the product reads from the environment): it prints
# PAUSED and waits for a line on stdin, so a signal lands exactly between checkpoints 3 and 6,
# however fast or loaded the machine (no sleep, no polling window).
PAUSING_CLI = """
import sys
from normswap import testing
from normswap.finetune import trainer

def pause(step):
    if step == 3:
        print("PAUSED", flush=True)
        sys.stdin.readline()

run = trainer.run_finetune

def run_pausing(cfg, hooks=None, **kw):  # the command's own hooks (its progress lines) still run
    theirs = hooks or testing.FinetuneHooks()

    def after_step(step):
        if theirs.after_step:
            theirs.after_step(step)
        pause(step)

    return run(cfg, hooks=testing.FinetuneHooks(loss=theirs.loss, after_step=after_step), **kw)

trainer.run_finetune = run_pausing
from normswap.cli.main import main
main(sys.argv[1:])
"""


def _cli_args(model, out, **kw):
    kw = {**RESUME_ARGS, **kw}
    args = [
        sys.executable,
        "-c",
        PAUSING_CLI,
        "finetune",
        str(model),
        str(out),
        "--seq-len",
        str(SEQ),
        "--batch-size",
        "4",
        "--eval-tokens",
        "1024",
        "--device",
        "cpu",
    ]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return args


@pytest.fixture(scope="module")
def uninterrupted(models, built_once):
    """The reference trajectory of the three kill/resume tests: one uninterrupted run, once per test run."""
    root = built_once("finetune-uninterrupted", lambda d: _run(models["approx"], d / "straight", **RESUME_ARGS))
    return root / "straight"


def _start_and_wait_for_checkpoint(models, out, step=3):
    """The CLI fine-tune in a child, returned once it has saved checkpoint ``step`` and paused."""
    proc = subprocess.Popen(
        _cli_args(models["approx"], out),
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if not any(line.strip() == "PAUSED" for line in proc.stdout):
        raise AssertionError(f"the run never paused: {proc.communicate(timeout=60)[1][-3000:]}")
    assert (out / "checkpoints" / f"step-{step}" / "trainer_state.json").exists()
    return proc


def _assert_same_trajectory(a, b):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    worst = max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa)
    assert worst <= 1e-6, worst
    la, lb = _log(a), _log(b)
    assert [r["step"] for r in la] == [r["step"] for r in lb]
    for ra, rb in zip(la, lb):
        assert ra.get("loss") == pytest.approx(rb.get("loss"), abs=1e-6) and ra["lr"] == rb["lr"]


def test_sigkill_then_resume_matches_uninterrupted_run(models, uninterrupted, tmp_path):
    out = tmp_path / "killed"
    proc = _start_and_wait_for_checkpoint(models, out)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "config.json").exists()  # it really died before finishing
    s = _run(models["approx"], out, resume=True, **RESUME_ARGS)
    assert s["resumed_from_step"] == 3
    _assert_same_trajectory(out, uninterrupted)
    # negative control: a different seed is a different trajectory, and the comparison sees it
    other = tmp_path / "other-seed"
    _run(models["approx"], other, **{**RESUME_ARGS, "seed": 8})
    with pytest.raises(AssertionError):
        _assert_same_trajectory(other, uninterrupted)


def test_sigint_saves_exits_cleanly_and_resumes(models, uninterrupted, tmp_path):
    out = tmp_path / "interrupted"
    proc = _start_and_wait_for_checkpoint(models, out)
    proc.send_signal(signal.SIGINT)
    proc.stdin.write("\n")  # let it go on: the signal is seen during step 4, which it saves
    proc.stdin.flush()
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 130, err
    assert "interrupted at step" in err and "--resume" in err and "Traceback" not in err
    saved = sorted(int(p.name[5:]) for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert saved and saved[-1] == 4  # it saved the step it was on (4), not just the last periodic one (3)
    assert not (out / "config.json").exists()
    s = _run(models["approx"], out, resume=True, **RESUME_ARGS)
    assert s["resumed_from_step"] == saved[-1]
    _assert_same_trajectory(out, uninterrupted)


class _Evil:
    """Unpickling this writes a marker file: what a crafted checkpoint file would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "code ran"))


def test_resume_never_unpickles_and_falls_back_past_broken_checkpoints(models, uninterrupted, tmp_path):
    import pickle
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from normswap.errors import NormswapError
    from normswap.finetune.trainer import TrainingDiverged

    out = tmp_path / "tampered"
    with pytest.raises(TrainingDiverged):
        _run(models["approx"], out, hooks=_nan_at(8), **RESUME_ARGS)
    ck = out / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step-3", "step-6"]
    # step-6: an attacker's pickle under every name a pickle-based format would read
    marker = tmp_path / "pwned"
    for name in ("optimizer.pt", "optimizer.bin", "custom_checkpoint_0.pkl", "random_states_0.pkl", "scheduler.bin"):
        (ck / "step-6" / name).write_bytes(pickle.dumps(_Evil(marker)))
    # step-5: exploded weights (what an unchecked divergence would have left); step-4: garbage optimizer file
    shutil.copytree(ck / "step-3", ck / "step-5")
    with safe_open(ck / "step-5" / "model.safetensors", "pt") as f:
        metadata = f.metadata()  # the names of tied weights
    w = load_file(ck / "step-5" / "model.safetensors")
    save_file({k: v * 1e6 for k, v in w.items()}, ck / "step-5" / "model.safetensors", metadata=metadata)
    shutil.copytree(ck / "step-3", ck / "step-4")
    (ck / "step-4" / "optimizer.pt").write_bytes(os.urandom(4096))

    evil = pickle.dumps(_Evil(marker))
    pickle.loads(evil)  # negative control: unpickled, the file does run code
    assert marker.exists()
    marker.unlink()

    # with no intact checkpoint at all, --resume refuses (naming each broken one) and changes nothing
    shutil.move(ck / "step-3", tmp_path / "step-3")
    shutil.copytree(tmp_path / "step-3", ck / "step-3")
    (ck / "step-3" / "trainer_state.json").write_text("{")
    log_before = (out / "train_log.jsonl").read_text()
    with pytest.raises(NormswapError, match="no intact checkpoint") as e:
        _run(models["approx"], out, resume=True, **RESUME_ARGS)
    assert all(f"step-{k}" in str(e.value) for k in (3, 4, 5, 6)) and str(ck / "step-3" / "trainer_state.json") in str(
        e.value
    )
    assert (out / "train_log.jsonl").read_text() == log_before
    shutil.rmtree(ck / "step-3")
    shutil.move(tmp_path / "step-3", ck / "step-3")

    said = []
    s = _run(models["approx"], out, resume=True, echo=said.append, **RESUME_ARGS)
    assert not marker.exists(), "a pickle in the checkpoint ran code"
    assert s["resumed_from_step"] == 3
    skipped = [m for m in said if "skipped the broken checkpoint" in m]
    assert len(skipped) == 3, said
    assert str(ck / "step-6" / "optimizer.pt") in skipped[0]
    assert str(ck / "step-5" / "model.safetensors") in skipped[1] and "exploded" in skipped[1]
    assert str(ck / "step-4" / "optimizer.pt") in skipped[2] and "cannot be read" in skipped[2]
    assert any(f"resuming from {ck / 'step-3'}" in m for m in said)
    _assert_same_trajectory(out, uninterrupted)  # the fallback loses nothing but time


# --- two processes ------------------------------------------------------------------------------


@pytest.mark.slow
def test_torchrun_two_processes_match_one_process(models, tmp_path):
    common = [
        "finetune",
        str(models["approx"]),
        None,
        "--steps",
        "4",
        "--seq-len",
        str(SEQ),
        "--batch-size",
        "8",
        "--grad-accum",
        "2",
        "--eval-tokens",
        "1024",
        "--lr",
        "2e-3",
        "--warmup-steps",
        "1",
        "--seed",
        "5",
        "--device",
        "cpu",
        "--save-every",
        "2",
        "--keep-checkpoints-after-finish",
    ]
    two = tmp_path / "two"
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "normswap"]
    r = checked_run(
        args + [str(two) if a is None else a for a in common], env=_env(), capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr[-3000:]
    # each process saved its own random state beside the shared weights and optimizer state
    assert {p.name for p in (two / "checkpoints" / "step-4").iterdir()} == {
        "model.safetensors",
        "optimizer.pt",
        "trainer_state.json",
        "rng-0.safetensors",
        "rng-0.json",
        "rng-1.safetensors",
        "rng-1.json",
    }
    one = tmp_path / "one"
    _run(models["approx"], one, steps=4, batch_size=8, grad_accum=2, lr=2e-3, warmup_steps=1, seed=5)
    l2, l1 = _log(two), _log(one)
    assert all(r["world_size"] == 2 for r in l2) and all(r["world_size"] == 1 for r in l1)
    for r2, r1 in zip(l2[1:], l1[1:]):
        # each rank trained on its own half of the same global batch ...
        assert len(r2["data_fingerprint"]) == 2 and r2["data_fingerprint"][0] != r2["data_fingerprint"][1]
        assert r1["data_fingerprint"][0] not in r2["data_fingerprint"]
        # ... and the averaged gradient is the one-process gradient: same curve up to float order
        # (measured: |Δloss| ~ 2e-7, |Δgrad_norm|/grad_norm ~ 1e-7; stated tolerance 1e-5)
        assert r2["loss"] == pytest.approx(r1["loss"], abs=1e-5)
        assert r2["grad_norm"] == pytest.approx(r1["grad_norm"], rel=1e-5)
    assert l2[-1]["eval_loss"] == pytest.approx(l1[-1]["eval_loss"], abs=1e-5)
    assert l2[0]["eval_loss"] == pytest.approx(l1[0]["eval_loss"], abs=1e-6)
    w2, w1 = _weights(two), _weights(one)
    # Adam divides by sqrt(v): on near-zero gradients a 1e-7 difference moves a weight by up to
    # ~1e-5 after a few steps (measured 1.5e-5 here with lr 2e-3), so weights get a looser bound
    assert w2.keys() == w1.keys() and max(float((w2[k] - w1[k]).abs().max()) for k in w1) < 1e-4


def test_force_replaces_a_run_with_one_complete_out_at_every_instant(tmp_path, monkeypatch):
    """--force builds the fresh run beside OUT and swaps it in: a failure (or kill) before the swap
    leaves the old OUT whole; after it, OUT is the fresh run. Negative control: deleting OUT first
    (the old behaviour) leaves nothing behind when the swap never happens: run below."""
    from normswap.errors import NormswapError
    from normswap.finetune import run_dir as rd

    out = tmp_path / "ft"
    out.mkdir()
    (out / "weights.bin").write_text("old model")
    run = {"status": "running", "config": {"lr": 1e-3}, "resumes": []}

    with pytest.raises(NormswapError):
        rd.RunDir(out).start(run, replace=False)  # no --force: refused, OUT untouched

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed before publishing")

    monkeypatch.setattr(rd, "publish_dir", killed)
    with pytest.raises(KeyboardInterrupt):
        rd.RunDir(out).start(run, replace=True)
    assert (out / "weights.bin").read_text() == "old model"
    assert not list(tmp_path.glob(".ft*staging*")), "the staging directory is removed on failure"

    # negative control, run: the old behaviour (delete OUT first, then start) under the same kill
    # leaves nothing behind, which the check above (old OUT whole) catches
    import shutil

    control = tmp_path / "control"
    control.mkdir()
    (control / "weights.bin").write_text("old model")
    real_start = rd.RunDir.start

    def delete_then_start(self, run, replace):
        if replace:
            shutil.rmtree(self.out)
        return real_start(self, run, replace=replace)

    monkeypatch.setattr(rd.RunDir, "start", delete_then_start)
    with pytest.raises(KeyboardInterrupt):
        rd.RunDir(control).start(run, replace=True)
    assert not (control / "weights.bin").exists()  # the old OUT is lost: the check above would fail

    monkeypatch.undo()
    rd.RunDir(out).start(run, replace=True)
    assert not (out / "weights.bin").exists()
    assert (
        rd.RunDir(out).read_run() == run
        and (out / "checkpoints").is_dir()
        and (out / "train_log.jsonl").read_text() == ""
    )


# --- FSDP: the shipped accelerate config -------------------------------------------------------


def _fsdp_config(tmp_path, device: str, processes: int) -> Path:
    """The shipped normswap/finetune/configs/fsdp.yaml, changed only where this machine needs it:
    on the CPU use_cpu (gloo) and no mixed precision (bf16 autocast is a GPU setting); on a GPU
    no mixed precision either, so both runs compare in float32."""
    import yaml

    cfg = yaml.safe_load((REPO / "normswap" / "finetune" / "configs" / "fsdp.yaml").read_text())
    assert cfg["distributed_type"] == "FSDP" and cfg["fsdp_config"]["fsdp_state_dict_type"] == "FULL_STATE_DICT"
    cfg.update(use_cpu=device == "cpu", mixed_precision="no", num_processes=processes)
    path = tmp_path / "fsdp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(
                    not torch.cuda.is_available(), reason="needs CUDA (bench/gpu.sh runs it on the GPU machine)"
                ),
            ],
        ),
    ],
)
def test_fsdp_processes_match_one_process(models, tmp_path, device):
    """`accelerate launch --config_file fsdp.yaml` (the README's FSDP line) trains what one plain
    process trains: two ranks, each with its half of every global batch and its shard of the
    weights, give the one-process loss curve up to float order, and the model gathered on rank 0
    is the one-process model. On one GPU the FSDP run has one process (NCCL puts one rank on a GPU)."""
    processes = 2 if device == "cpu" else min(2, torch.cuda.device_count())
    steps = 3
    common = [
        "finetune",
        str(models["approx"]),
        None,
        "--steps",
        str(steps),
        "--seq-len",
        str(SEQ),
        "--batch-size",
        "8",
        "--eval-tokens",
        "512",
        "--lr",
        "2e-3",
        "--warmup-steps",
        "1",
        "--seed",
        "5",
        "--device",
        device,
        "--dtype",
        "float32",
        "--no-progress",
    ]
    fsdp = tmp_path / "fsdp"
    import socket

    with socket.socket() as sock:  # a free port: the default (29500) would collide with another run on this machine
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(_fsdp_config(tmp_path, device, processes)),
        "--num_processes",
        str(processes),
        "--main_process_port",
        str(port),
        "-m",
        "normswap",
    ]
    r = subprocess.run(
        args + [str(fsdp) if a is None else a for a in common], env=_env(), capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr[-3000:]
    one = tmp_path / "one"
    _run(
        models["approx"],
        one,
        steps=steps,
        batch_size=8,
        eval_tokens=512,
        lr=2e-3,
        warmup_steps=1,
        seed=5,
        device=device,
        dtype="float32",
    )
    lf, l1 = _log(fsdp), _log(one)
    assert [r["step"] for r in lf] == [r["step"] for r in l1] == list(range(steps + 1))
    assert all(r["world_size"] == processes for r in lf) and all(r["world_size"] == 1 for r in l1)
    for rf, r1 in zip(lf[1:], l1[1:]):
        if processes == 2:  # each rank trained on its own half of the same global batch
            assert len(rf["data_fingerprint"]) == 2 and rf["data_fingerprint"][0] != rf["data_fingerprint"][1]
        assert rf["loss"] == pytest.approx(r1["loss"], abs=1e-5)
        assert rf["grad_norm"] == pytest.approx(r1["grad_norm"], rel=1e-4)
    assert lf[-1]["eval_loss"] == pytest.approx(l1[-1]["eval_loss"], abs=1e-5)
    # control: training moved the model, by far more than the tolerance above (a run that did not
    # train, or trained on other data, cannot pass by being close to an unchanged start)
    assert abs(l1[-1]["eval_loss"] - l1[0]["eval_loss"]) > 1e-3
    wf, w1 = _weights(fsdp), _weights(one)
    assert wf.keys() == w1.keys() and max(float((wf[k] - w1[k]).abs().max()) for k in w1) < 1e-4
