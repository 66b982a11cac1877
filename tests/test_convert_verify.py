"""Verification: on by default, module by module in bounded memory, the same figures as whole models;
a wrong conversion exits 1 and publishes nothing; --tolerance; the up-front memory check."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import tiny_model
from transformers import AutoModelForCausalLM

from normswap.convert import execute, pipeline


@pytest.fixture(scope="module")
def neox_src(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "neox"
    tiny_model("gpt_neox", 0).save_pretrained(path, max_shard_size="30KB")
    return path


@pytest.fixture
def centring_disabled(monkeypatch):
    """A deliberately wrong exact conversion: the plan keeps its folds but centres nothing."""
    original = execute.build_plan

    def wrong_plan(*args, **kwargs):
        plan = original(*args, **kwargs)
        for key in [k for k, op in plan.derivations.items() if op["op"] == "center_rows"]:
            del plan.derivations[key]
        for op in plan.derivations.values():
            if "center" in op:
                op["center"] = False
        return plan

    monkeypatch.setattr(execute, "build_plan", wrong_plan)


def _logprobs(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.double().log_softmax(-1)


def test_module_by_module_figures_equal_whole_models(neox_src, tmp_path, run_cli):
    """Every figure of the pass rule from the blockwise runs is the one whole models give on the same
    probe: max |Δ log-prob| float32 vs float32, the source's float32 noise floor, the converted float32
    model's drift from the float64 source; and the conversion computed in float64 is exact to float64
    rounding (the whole float32 checkpoint cast to float64 is not: its weights were rounded)."""
    from normswap.convert.verify import verification_ids

    code, out, err = run_cli("convert", neox_src, tmp_path / "out", "--json")
    assert code == 0, err
    ver = json.loads(out)["verification"]
    assert ver["passed"] is True and ver["threshold"] == 1e-5
    assert ver["exact_threshold"] == max(1e-7, 2 * ver["noise_floor"])  # pass_rule: a float32-computing share

    src = AutoModelForCausalLM.from_pretrained(neox_src, dtype=torch.float32).eval()
    conv = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True, dtype=torch.float32).eval()
    ids = verification_ids(None, src.config)["input_ids"]
    assert ver["probe_tokens"] == ids.numel()
    src32, conv32 = _logprobs(src, ids), _logprobs(conv, ids)
    truth = _logprobs(src.double(), ids)
    assert ver["max_abs_diff"] == pytest.approx(float((src32 - conv32).abs().max()), rel=1e-9, abs=1e-12)
    assert ver["noise_floor"] == pytest.approx(float((src32 - truth).abs().max()), rel=1e-9, abs=1e-12)
    assert ver["drift_float32"] == pytest.approx(float((conv32 - truth).abs().max()), rel=1e-9, abs=1e-12)
    cast = float((_logprobs(conv.double(), ids) - truth).abs().max())
    assert ver["exact_float64"] < 1e-12 < cast  # the control: float32-rounded weights are not the exact fold


def test_16_bit_rounding_floor_is_the_unrounded_weights_difference(neox_src, tmp_path, run_cli):
    """bfloat16 output: the drift exceeds --tolerance, so the rounding floor is measured (converted weights
    before their rounding, with the conversion's own float32 arithmetic) and covers it; the conversion
    itself is exact in float64."""
    code, out, err = run_cli("convert", neox_src, tmp_path / "out", "--json", "--dtype", "bfloat16")
    assert code == 0, err
    ver = json.loads(out)["verification"]
    assert ver["max_abs_diff"] > 1e-4 and ver["rounding_floor"] > 0 and ver["exact_float64"] < 1e-12
    assert ver["threshold"] == pytest.approx(4 * ver["rounding_floor"]) and ver["passed"] is True
    assert ver["drift_float32"] <= ver["threshold"]


def test_wrong_conversion_exits_1_and_publishes_nothing(neox_src, tmp_path, run_cli, centring_disabled):
    code, _, err = run_cli("convert", neox_src, tmp_path / "out")
    assert code == 1, err
    line = [x for x in err.splitlines() if x.startswith("normswap: error:")]
    assert len(line) == 1 and "verification failed" in line[0] and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if ".normswap-staging-" in p.name]


def test_tolerance_widens_the_float32_half_only(neox_src, tmp_path, run_cli, centring_disabled):
    """--tolerance bounds the float32 drift; it cannot pass a conversion that is not exact in float64."""
    code, out, err = run_cli("convert", neox_src, tmp_path / "loose", "--tolerance", "1e3", "--json")
    assert code == 1 and not (tmp_path / "loose").exists()
    assert "not exact: float64 max |Δ| = " in err + out
    assert "max |Δ log-prob|" in err + out  # a causal LM: log-probabilities compared


def test_verification_that_would_not_fit_is_refused_up_front(neox_src, tmp_path, run_cli, monkeypatch):
    monkeypatch.setattr(pipeline, "available_memory", lambda: 10_000)
    code, _, err = run_cli("convert", neox_src, tmp_path / "out")
    assert code == 2 and "--no-verify" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # refused before anything was written
    code, _, err = run_cli("convert", neox_src, tmp_path / "out", "--no-verify")
    assert code == 0, err


# -- memory: measured in a child process ---------------------------------------------------------

# Anonymous memory (RssAnon): what the conversion itself holds. Total RSS also counts file-backed
# pages of the source and of the output being filled; those are page cache the kernel reclaims at
# will. It is read at every return from a normswap function (a profile hook: deterministic, so
# the resident control's peak cannot be missed) and by a 2 ms sampler besides.
_CHILD = textwrap.dedent("""
    import json, sys, threading, time
    import torch, transformers
    from normswap.checkpoint.load import load_config
    from normswap.convert import tensor_match, pipeline, verify

    def anon():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    src, out, shard, how = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    config = load_config(src)
    skel = tensor_match.skeleton(config)  # imports the modeling code (~200 MB of modules), not part of the data
    estimate = verify.peak_bytes(skel, config, rounding=False)
    baseline = anon()
    peak = [baseline]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.002)

    def at_return(frame, event, arg):
        # every return from a normswap function: its locals (the tensors it holds) are still alive,
        # so a peak held by any normswap frame is read here, whatever the scheduler does
        if event == "return" and frame.f_globals.get("__name__", "").startswith("normswap"):
            peak[0] = max(peak[0], anon())

    t = threading.Thread(target=sample, daemon=True)  # also catches peaks inside long C calls
    t.start()
    sys.setprofile(at_return)
    threading.setprofile(at_return)
    if how == "resident":  # the negative control: the same verification with every weight loaded at once
        verify.Blockwise.__call__ = verify.Blockwise.resident
    pipeline.convert_checkpoint(src, out, verify=True, max_shard_size=shard)
    sys.setprofile(None)
    threading.setprofile(None)
    done.set()
    t.join()
    peak[0] = max(peak[0], anon())
    print(json.dumps({"baseline": baseline, "peak": peak[0], "estimate": estimate}))
""")


def _in_child(src, out, shard, how):
    env = dict(os.environ, NORMSWAP_KERNEL="torch", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(out), str(shard), how],
        capture_output=True,
        text=True,
        env=env,
        timeout=800,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_verified_conversion_stays_near_a_shard_not_the_model(tmp_path):
    """A ~330 MB float32 checkpoint in 4 shards, converted *with* verification: anonymous memory grows by
    less than 2.5 shards, within the up-front estimate; the same verification with all weights resident grows by
    more than the model."""
    from helpers import tiny_config
    from transformers import GPTNeoXForCausalLM

    config = tiny_config(
        "gpt_neox",
        0,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=6,
        num_attention_heads=16,
        vocab_size=8192,
        tie_word_embeddings=False,
    )
    GPTNeoXForCausalLM(config).save_pretrained(tmp_path / "src", max_shard_size="100MB")
    files = sorted((tmp_path / "src").glob("*.safetensors"))
    model_bytes = sum(f.stat().st_size for f in files)
    shard = max(f.stat().st_size for f in files)
    assert model_bytes > 300e6 and len(files) >= 4

    got = _in_child(tmp_path / "src", tmp_path / "out", shard, "convert")
    growth = got["peak"] - got["baseline"]
    assert growth < 2.5 * shard, f"grew by {growth / 1e6:.0f} MB (largest shard {shard / 1e6:.0f} MB)"
    assert growth <= got["estimate"], f"grew by {growth / 1e6:.0f} MB, estimated {got['estimate'] / 1e6:.0f} MB"
    manifest = json.loads((tmp_path / "out" / "normswap_manifest.json").read_text())
    assert manifest["verification"]["passed"] is True

    whole = _in_child(tmp_path / "src", tmp_path / "resident", shard, "resident")
    assert whole["peak"] - whole["baseline"] > model_bytes
