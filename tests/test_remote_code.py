"""No code from data: a model directory's Python files never run unless --trust-remote-code.

The attacker's files are crafted here: an ``auto_map`` module in a source model, and a converted
checkpoint whose ``modeling_normswap.py`` was replaced. Each writes a marker file when imported;
the positive controls show that the same files do run where running them is asked for.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import checked_run

from normswap.assets.models import model_path

ROOT = Path(__file__).resolve().parents[1]

EVIL = textwrap.dedent("""
    import pathlib
    pathlib.Path({marker!r}).write_text("ran")
    from transformers import GPT2Config


    class EvilConfig(GPT2Config):
        model_type = {model_type!r}
""")


def _evil_source(root: Path, *, model_type: str) -> tuple[Path, Path]:
    """The shipped KJV GPT-2 (real weights, real tokenizer) with an auto_map to a marker-writing module."""
    src = root / f"evil-{model_type}"
    shutil.copytree(model_path("kjv-gpt2"), src)
    marker = root / f"marker-{model_type}"
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = model_type
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "configuration_evil.py").write_text(EVIL.format(marker=str(marker), model_type=model_type))
    return src, marker


def _env(tmp_path):
    # transformers copies remote code into its module cache: keep that inside the test's directory
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_MODULES_CACHE": str(tmp_path / "hf_modules")}


def _errors(err):
    return [line for line in err.strip().splitlines() if line.startswith("normswap: error:")]


def test_auto_map_of_a_known_model_type_is_ignored(tmp_path, run_cli):
    """model_type gpt2 + auto_map: transformers' own GPT-2 classes load it; the module never runs."""
    src, marker = _evil_source(tmp_path, model_type="gpt2")
    code, _, err = run_cli("convert", src, tmp_path / "out", "--no-verify")
    assert code == 0, err
    code, out, err = run_cli("eval", "ppl", src, "--max-tokens", "256", "--seq-len", "64", "--quiet")
    assert code == 0, err
    assert "perplexity" in out
    assert not marker.exists()
    # the converted output names normswap's own code, not the source's module
    assert json.loads((tmp_path / "out" / "config.json").read_text())["auto_map"]["AutoConfig"].startswith(
        "modeling_normswap."
    )


def test_auto_map_of_an_unknown_model_type_is_refused_in_one_line_and_the_flag_runs_it(tmp_path, run_cli):
    src, marker = _evil_source(tmp_path, model_type="evil_type")
    for args in (("convert", src, tmp_path / "out"), ("eval", "ppl", src, "--quiet")):
        code, _, err = run_cli(*args)
        assert code == 2 and "Traceback" not in err, err
        lines = _errors(err)
        assert len(lines) == 1 and "--trust-remote-code" in lines[0] and "configuration_evil.py" in lines[0], err
        assert not marker.exists()
        assert not (tmp_path / "out").exists()
    # positive control: asked for, the same file runs (in a child, so that its import stays there)
    proc = checked_run(
        [sys.executable, "-m", "normswap", "convert", str(src), str(tmp_path / "out"), "--trust-remote-code"],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert marker.read_text() == "ran"
    warnings = [line for line in proc.stderr.splitlines() if "warning: --trust-remote-code" in line]
    assert len(warnings) == 1, proc.stderr


def test_the_flag_does_not_outlive_its_command(tmp_path, run_cli):
    src, marker = _evil_source(tmp_path, model_type="evil_type")
    run_cli(
        "eval", "ppl", "normswap:kjv-gpt2", "--max-tokens", "128", "--seq-len", "64", "--quiet", "--trust-remote-code"
    )
    code, _, err = run_cli("eval", "ppl", src, "--quiet")
    assert code == 2 and "--trust-remote-code" in err and not marker.exists()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from normswap.convert.pipeline import convert_checkpoint

    out = tmp_path_factory.mktemp("conv") / "out"
    convert_checkpoint("normswap:kjv-gpt2", out, mode="exact", verify=False)
    return out


def test_replaced_modeling_file_of_a_converted_checkpoint_never_runs_in_normswap(converted, tmp_path, run_cli):
    import normswap

    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted, ckpt)
    marker = tmp_path / "marker"
    (ckpt / "modeling_normswap.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        + (converted / "modeling_normswap.py").read_text()
    )
    model = normswap.load_model(ckpt)
    assert type(model).__module__ == "normswap.checkpoint.remote_code"
    # the classes built from the package compute what the source computes (an exact conversion)
    source = normswap.load_model("normswap:kjv-gpt2")
    ids = torch.arange(40).unsqueeze(0)
    with torch.no_grad():
        diff = (model(input_ids=ids).logits.log_softmax(-1) - source(input_ids=ids).logits.log_softmax(-1)).abs().max()
    assert diff < 1e-4
    # through the CLI too, even with --trust-remote-code: normswap's own checkpoints always use normswap's code
    code, _, err = run_cli(
        "eval", "ppl", ckpt, "--max-tokens", "256", "--seq-len", "64", "--quiet", "--trust-remote-code"
    )
    assert code == 0, err
    assert not marker.exists()
    # positive control: plain transformers asked to trust the directory does import that file
    script = (
        "from transformers import AutoModelForCausalLM; "
        f"AutoModelForCausalLM.from_pretrained({str(ckpt)!r}, trust_remote_code=True)"
    )
    subprocess.run([sys.executable, "-c", script], env=_env(tmp_path), capture_output=True, timeout=300)
    assert marker.read_text() == "ran"


def test_a_normswap_config_naming_a_non_model_class_is_refused(converted, tmp_path):
    import normswap
    from normswap.errors import NormswapError

    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["auto_map"]["AutoModelForCausalLM"] = "modeling_normswap.Normswapset_seed"  # transformers.set_seed: a function
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NormswapError, match="not a transformers model class"):
        normswap.load_model(ckpt)


def test_only_the_command_line_flag_lets_a_recipe_run_a_sources_code(tmp_path):
    """A recipe whose source ships an auto_map module: refused in one line without the flag, and the
    module runs (with the one-line warning) only where the person running it passes
    ``--trust-remote-code`` (a recipe's own ``trust_remote_code: true`` grants nothing:
    tests/test_recipe_trust.py)."""
    src, marker = _evil_source(tmp_path, model_type="evil_type")
    recipe = textwrap.dedent(f"""\
        name: evil
        source: {src}
        {{key}}
        variants:
          exact: {{{{convert: {{{{mode: exact}}}}}}}}
        eval: {{{{seq_len: 64, stride: 64, max_tokens: 128, speed: false, diagnostics: false}}}}
    """)
    runs = {}
    for name, flag in (("plain", []), ("trusted", ["--trust-remote-code"])):
        path = tmp_path / f"{name}.yaml"
        path.write_text(recipe.format(key=""))
        runs[name] = checked_run(
            [sys.executable, "-m", "normswap", "run", str(path), "--out", str(tmp_path / f"run-{name}"), *flag],
            env=_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=600,
        )
        if name == "plain":
            assert runs[name].returncode != 0 and "Traceback" not in runs[name].stderr, runs[name].stderr
            assert len(_errors(runs[name].stderr)) == 1 and "--trust-remote-code" in runs[name].stderr
            assert not marker.exists()
    assert marker.read_text() == "ran", runs["trusted"].stderr
    assert sum("warning: --trust-remote-code" in line for line in runs["trusted"].stderr.splitlines()) == 1


PLAIN_TRANSFORMERS = textwrap.dedent("""
    # A user's script with stock transformers. Every question transformers would ask on a
    # terminal ("run the custom code? [y/N]") is answered "no" and counted; warnings are counted.
    import builtins, json, logging, sys, warnings
    prompts = []
    builtins.input = lambda *a, **k: prompts.append(str(a)[:80]) or "n"
    records = []
    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage()[:120])
    logging.getLogger("transformers").addHandler(Collect())
    warnings.simplefilter("error")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    path, source = sys.argv[1], sys.argv[2]
    result = {}
    tok = AutoTokenizer.from_pretrained(path)
    result["ids"] = tok("In the beginning God created the heaven")["input_ids"]
    result["source_ids"] = AutoTokenizer.from_pretrained(source)("In the beginning God created the heaven")["input_ids"]
    result["config_type"] = type(AutoConfig.from_pretrained(path)).__name__
    result["tokenizer_prompts"], result["tokenizer_warnings"] = list(prompts), list(records)
    try:
        AutoModelForCausalLM.from_pretrained(path)
        result["stock_model"] = "loaded"
    except Exception as e:
        result["stock_model"] = type(e).__name__ + ": " + str(e).splitlines()[0]
    warnings.simplefilter("default")
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    with torch.no_grad():
        result["logits"] = model(input_ids=torch.tensor([result["ids"]])).logits[0, -1, :8].tolist()
    print(json.dumps(result))
""")


def _plain_transformers(ckpt: Path, tmp_path: Path) -> dict:
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_TRANSFORMERS)
    done = subprocess.run(
        [sys.executable, str(script), str(ckpt), str(model_path("kjv-gpt2"))],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_plain_transformers_reads_tokenizer_and_config_without_code_or_prompts_and_refuses_the_stock_model(
    converted, tmp_path
):
    """The converted checkpoint keeps GPT-2's built-in model_type, so AutoTokenizer and AutoConfig
    need no remote code and ask nothing; its weights are the "normswap" variant, so the stock GPT-2
    class (which would build LayerNorm) finds none and fails loudly, while trust_remote_code=True
    builds the converted model, which computes what normswap's own loader computes."""
    import normswap

    r = _plain_transformers(converted, tmp_path)
    assert r["ids"] == r["source_ids"] and len(r["ids"]) > 3
    assert r["config_type"] == "GPT2Config"
    assert r["tokenizer_prompts"] == [] and r["tokenizer_warnings"] == []
    assert r["stock_model"].startswith("OSError") and "model.safetensors" in r["stock_model"]
    ours = normswap.load_model(converted)
    with torch.no_grad():
        expected = ours(input_ids=torch.tensor([r["ids"]])).logits[0, -1, :8]
    torch.testing.assert_close(torch.tensor(r["logits"]), expected, rtol=1e-5, atol=1e-5)

    # negative control: the earlier format (a model type of normswap's own, weights under the stock
    # name) makes AutoTokenizer ask to run code, and normswap still loads it, to the same numbers
    old = tmp_path / "old-format"
    shutil.copytree(converted, old)
    cfg = json.loads((old / "config.json").read_text())
    cfg["model_type"] = "normswap_gpt2"
    del cfg["normswap"]["weights_variant"]
    (old / "config.json").write_text(json.dumps(cfg))
    (old / "model.normswap.safetensors").rename(old / "model.safetensors")
    script = tmp_path / "old.py"
    script.write_text(
        PLAIN_TRANSFORMERS.split("result = {}")[0] + "AutoTokenizer.from_pretrained(path)\nprint(len(prompts))\n"
    )
    done = subprocess.run(
        [sys.executable, str(script), str(old), "-"], env=_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and int(done.stdout.strip().splitlines()[-1]) >= 1, done.stderr[-2000:]
    with torch.no_grad():
        again = normswap.load_model(old)(input_ids=torch.tensor([r["ids"]])).logits[0, -1, :8]
    torch.testing.assert_close(again, expected, rtol=0, atol=0)


def test_a_converted_model_saved_by_plain_transformers_keeps_the_guard(converted, tmp_path):
    """save_pretrained of the remote-code class writes the variant again, so a re-saved checkpoint
    is as safe as the converted one (stock class refused) and normswap loads it."""
    import normswap

    src, dst = str(converted), str(tmp_path / "resaved")
    script = textwrap.dedent(f"""
        from transformers import AutoModelForCausalLM
        AutoModelForCausalLM.from_pretrained({src!r}, trust_remote_code=True).save_pretrained({dst!r})
    """)
    done = subprocess.run(
        [sys.executable, "-c", script], env=_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    resaved = tmp_path / "resaved"
    assert (resaved / "model.normswap.safetensors").is_file() and not (resaved / "model.safetensors").exists()
    ids = torch.arange(30).unsqueeze(0)
    with torch.no_grad():
        a = normswap.load_model(converted)(input_ids=ids).logits
        b = normswap.load_model(resaved)(input_ids=ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)
