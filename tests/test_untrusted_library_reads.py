"""Everything transformers, PEFT, tokenizers or safetensors would read from a model directory is checked
by normswap before they read it: links, type, size (a cap derived from what the file must hold), and
what it would build (an adapter's layers, a vocabulary's largest id) bounded by what the weights back.

Each attack runs the real command in a child under a 4 GB address-space cap and a 1 GB file-size cap
(tests/helpers.py's ``normswap_capped``), on a copy of the shipped ``kjv-gpt2``; the control
is the same directory with the planted file removed (or left as normswap wrote it), which still runs.
On normswap 9e09e2f (before this rule) each attack test failed at the line marked "fails before".
"""

import json
from pathlib import Path

import pytest
from helpers import normswap_capped

ROOT = Path(__file__).resolve().parents[1]
EVAL = ("eval", "ppl", "--max-tokens", "128", "--seq-len", "32", "--device", "cpu", "--quiet")


def _normswap(*args) -> tuple[int, str]:
    return normswap_capped(*args, timeout=120)


def _error_line(code: int, err: str, *needles) -> str:
    """The one error line of a refused command (progress lines start with the command's name)."""
    progress = ("normswap convert:", "normswap finetune:", "normswap eval ")
    lines = [line for line in err.strip().splitlines() if not line.startswith(progress)]
    assert code != 0 and len(lines) == 1 and "Traceback" not in err, (code, err)
    for needle in needles:
        assert needle in lines[0], err
    return lines[0]


def _kjv_copy(dest: Path) -> Path:
    from normswap.assets.models import model_path

    dest.mkdir()
    for p in Path(model_path("kjv-gpt2")).iterdir():
        (dest / p.name).write_bytes(p.read_bytes())
    return dest


def _sparse(path: Path, head: bytes, size: int) -> Path:
    """A file of ``size`` bytes that takes no disk: ``head``, then a hole (zeros) to the end."""
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return path


def test_an_adapter_config_is_refused_before_transformers_builds_the_adapter(tmp_path, run_cli):
    """A 170-byte adapter_config.json, LoRA rank 2e7 on c_attn (width 128) and no adapter weights: with
    PEFT installed, transformers built the adapter before reading any weight and asked for 10,240,000,000
    bytes (9e09e2f: "cannot load weights of ...: can't allocate memory" under the cap)."""
    pytest.importorskip("peft")  # without PEFT transformers ignores the file; the refusal holds either way
    src = _kjv_copy(tmp_path / "src")
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 20_000_000,
        "lora_alpha": 1,
        "target_modules": ["c_attn"],
        "base_model_name_or_path": "unused",
    }
    (src / "adapter_config.json").write_text(json.dumps(adapter))
    code, err = _normswap(*EVAL, src)
    _error_line(code, err, "adapter_config.json", "merge it into its base model first")  # fails before
    code, _, err = run_cli("convert", src, tmp_path / "out")  # refused when the model is resolved: no child needed
    assert code != 0 and "adapter_config.json" in err and not (tmp_path / "out").exists()
    # the control: the same model without the adapter evaluates
    (src / "adapter_config.json").unlink()
    code, out, _ = run_cli(*EVAL, src, "--json")
    assert code == 0 and json.loads(out)["models"][0]["perplexity"] > 1


def test_a_sparse_8_gb_tokenizer_json_is_refused_by_its_size_before_any_read_or_copy(tmp_path, run_cli):
    """A few bytes of JSON, then an 8 GB hole: convert copied it byte for byte into OUT (9e09e2f: stopped
    only by the 1 GB file-size limit) and eval ppl read it whole (MemoryError)."""
    src = _kjv_copy(tmp_path / "src")
    original = (src / "tokenizer.json").read_bytes()
    _sparse(src / "tokenizer.json", b'{"version": "1.0", "added_tokens": [', 8 << 30)
    code, err = _normswap("convert", src, tmp_path / "out")
    line = _error_line(code, err, "tokenizer.json", "8,192 MiB")  # fails before
    from normswap.checkpoint.side_files import MAX_VOCABULARY_FILE_BYTES

    assert f"at most {MAX_VOCABULARY_FILE_BYTES >> 20} MiB" in line and not (tmp_path / "out").exists()
    code, err = _normswap(*EVAL, src)
    _error_line(code, err, "tokenizer.json", "8,192 MiB")  # fails before
    # the copy itself is bounded too: a file that grows past its cap after the check is not copied whole
    from normswap.checkpoint.side_files import _copy_bounded
    from normswap.errors import NormswapError

    (tmp_path / "grown").mkdir()
    big = _sparse(tmp_path / "grown" / "tokenizer.json", b"{", MAX_VOCABULARY_FILE_BYTES + 1)
    with open(big, "rb") as f, open(tmp_path / "copy", "wb") as g, pytest.raises(NormswapError, match="at most"):
        _copy_bounded(f, g, big.parent, "tokenizer.json")
    assert (tmp_path / "copy").stat().st_size <= MAX_VOCABULARY_FILE_BYTES
    # the control: the real tokenizer.json is carried and evaluates
    (src / "tokenizer.json").write_bytes(original)
    code, _, _ = run_cli("convert", src, tmp_path / "out", "--no-verify")
    assert code == 0 and (tmp_path / "out" / "tokenizer.json").read_bytes() == original
    code, out, _ = run_cli(*EVAL, tmp_path / "out", "--json")
    assert code == 0 and json.loads(out)["models"][0]["perplexity"] > 1


def test_a_token_id_near_2_to_the_32_is_refused_before_the_tokenizer_is_built(tmp_path, run_cli):
    """One id of kjv-gpt2's 4,096-token vocabulary renumbered 4,294,967,000: finetune's save of the
    tokenizer asked tokenizers for an 8 GB table and the process aborted (9e09e2f: signal 6, no line)."""
    src = _kjv_copy(tmp_path / "src")
    original = (src / "tokenizer.json").read_bytes()
    tok = json.loads(original)
    last = max(tok["model"]["vocab"], key=tok["model"]["vocab"].get)
    tok["model"]["vocab"][last] = 4_294_967_000
    (src / "tokenizer.json").write_text(json.dumps(tok))
    args = ("finetune", src, tmp_path / "out", "--steps", "1", "--batch-size", "1", "--seq-len", "16")
    code, err = _normswap(*args)
    _error_line(code, err, "tokenizer.json", "4,294,967,000", "4,096 rows")  # fails before (code -6)
    assert not (tmp_path / "out").exists()
    # the control: the shipped tokenizer fine-tunes, and its published copy is the source's
    (src / "tokenizer.json").write_bytes(original)
    code, _, _ = run_cli(*args, "--eval-tokens", "64", "--device", "cpu")
    assert code == 0 and json.loads((tmp_path / "out" / "tokenizer.json").read_text())["model"]["vocab"][last] < 4096


def test_a_train_log_of_gigabytes_is_refused_not_read_whole(tmp_path, run_cli):
    """A model directory's train_log.jsonl (normswap finetune writes one) of 3 GB: eval ppl read it whole
    for the loss curve (9e09e2f: MemoryError under the cap)."""
    src = _kjv_copy(tmp_path / "src")
    rows = [{"step": s, "loss": 5.0 - s / 10} for s in range(1, 6)]
    _sparse(src / "train_log.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode(), 3 << 30)
    code, err = _normswap(*EVAL, src)
    line = _error_line(code, err, "train_log.jsonl", "3,072 MiB")  # fails before
    from normswap.finetune.run_dir import MAX_LOG_BYTES

    assert f"at most {MAX_LOG_BYTES >> 20} MiB" in line
    # one row of a megabyte is held only up to the row cap
    from normswap.errors import NormswapError
    from normswap.evaluate.model_info import finetune_curve

    (src / "train_log.jsonl").write_bytes(b'{"step": 1, "loss": "' + b"9" * (1 << 20) + b'"}\n')
    with pytest.raises(NormswapError, match="train_log.jsonl:1: a row longer than"):
        finetune_curve(src)
    # the control: a log of normal size is read, and its curve reaches results.json
    (src / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, _ = run_cli(*EVAL, src, "--json")
    assert code == 0, out
    curve = finetune_curve(src)
    assert curve["steps"] == [1, 2, 3, 4, 5] and curve["final_loss"] == pytest.approx(4.5)
