"""Config sizes that build containers and tables no weight backs are capped before anything is built
(issue #29, case 9; normswap/checkpoint/sizes.py).

`"num_labels": 100000000` without `id2label` made transformers build a 1e8-entry dict while it read
the config (MemoryError at 4 GB, tens of GB uncapped) in every command; GPT-J/CodeGen
`n_positions: 2e8` built an `n_positions × rotary_dim` table per layer (~25 GB). Now each is one line
in every command, under a 2 GiB address-space cap, with no model built (counted). Controls: the same
checkpoints with honest sizes go on to build their models.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from helpers import checked_run, tiny_model

from normswap.checkpoint import sizes
from normswap.errors import NormswapError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{name: directory}: a tiny GPT-2 and a tiny GPT-J, honest and with hostile config sizes."""
    root = tmp_path_factory.mktemp("sizes")
    out = {}
    for family, kw in (("gpt2", dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64)), ("gptj", {})):
        path = root / family
        tiny_model(family, **kw).save_pretrained(path)
        out[family] = path
    hostile = {
        "labels": ("gpt2", dict(num_labels=100_000_000)),
        "positions": ("gptj", dict(n_positions=200_000_000)),
        # under the positions cap, but 2 layers × 16M positions × 16 rotary dims: 2 GB beside 0.3 MB of weights
        "table": ("gptj", dict(n_positions=16_000_000, rotary_dim=16)),
    }
    for name, (family, change) in hostile.items():
        dest = root / name
        dest.mkdir()
        for p in out[family].iterdir():
            (dest / p.name).write_bytes(p.read_bytes())
        raw = json.loads((dest / "config.json").read_text())
        raw.pop("id2label", None)
        raw.pop("label2id", None)
        raw.update(change)
        (dest / "config.json").write_text(json.dumps(raw))
        out[name] = dest
    return out


def test_the_caps_are_checked_on_the_raw_dict():
    base = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64}
    sizes.check_declared(dict(base, num_labels=2), "m")  # controls: ordinary values pass
    sizes.check_declared(dict(base, num_labels=200_000, id2label={str(i): "x" for i in range(200_000)}), "m")
    with pytest.raises(NormswapError, match="num_labels is 100,000,000 with 0 named in id2label"):
        sizes.check_declared(dict(base, num_labels=100_000_000), "m")
    with pytest.raises(NormswapError, match=r"text_config.num_labels is 100,000,000"):
        sizes.check_declared(dict(base, text_config={"num_labels": 100_000_000}), "m")
    with pytest.raises(NormswapError, match="n_positions is 200,000,000; normswap accepts at most 16,777,216"):
        sizes.check_declared(dict(base, n_positions=200_000_000), "m")
    with pytest.raises(NormswapError, match="n_layer is 1,000,000,000; normswap accepts at most 1,048,576"):
        sizes.check_declared(dict(base, n_layer=10**9), "m")
    with pytest.raises(NormswapError, match="n_layer is 100,000; a model built from a config alone has at most 4,096"):
        sizes.check_without_weights(dict(base, n_layer=100_000), "m")
    # the table a config implies: per layer where rotary_dim is declared, else one row per position
    gptj = {"n_positions": 10_000_000, "rotary_dim": 64, "n_layer": 28, "n_embd": 4096}
    assert sizes.position_table_bytes(gptj) == 10_000_000 * 64 * 28 * 4
    assert sizes.position_table_bytes({"max_position_embeddings": 2048, "d_model": 1024}) == 2048 * 1024 * 4
    with pytest.raises(NormswapError, match="position table of 66.8 GiB"):
        sizes.check_without_weights(gptj, "m")
    sizes.check_without_weights(dict(gptj, n_positions=2048), "m")  # GPT-J's own context: 58 MB
    # against weights: a long context backed by weights of the same order is accepted (a 1M-context 7B model)
    qwen = {"max_position_embeddings": 1_010_000, "hidden_size": 3584, "num_hidden_layers": 28}
    sizes.check_against_weights(qwen, {"embed": (152064, 3584), "layers.27.w": (7_600_000_000 // 3584, 3584)}, "q")
    with pytest.raises(NormswapError, match="more than the weights. own size in float32 or 1 GiB"):
        sizes.check_against_weights(qwen, {"embed": (1024, 64), "layers.27.w": (64, 64)}, "q")


CHILD = r"""
import contextlib, io, json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # a hostile config must fit in 2 GiB
import transformers
from normswap.cli.main import main

built = []
original = transformers.PreTrainedModel.__init__
def counting(self, config, *args, **kwargs):
    built.append(type(self).__name__)
    original(self, config, *args, **kwargs)
transformers.PreTrainedModel.__init__ = counting

out = {}
for name, argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    del built[:]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException as e:
        code, _ = 99, err.write(f"{type(e).__name__}: {e}\n")
    out[name] = [code, err.getvalue(), len(built)]
print(json.dumps(out))
"""


def _commands(model: Path, tmp: Path, tag: str) -> list:
    m = str(model)
    return [
        (f"{tag}:convert", ["convert", m, str(tmp / f"{tag}-conv"), "--no-verify"]),
        (f"{tag}:eval", ["eval", "ppl", m, "--quiet", "--max-tokens", "64"]),
        (f"{tag}:export", ["export", m, str(tmp / f"{tag}-exp"), "--format", "stock"]),
        (f"{tag}:finetune", ["finetune", m, str(tmp / f"{tag}-ft"), "--steps", "1", "--seq-len", "32"]),
        (f"{tag}:study", ["study", m, "--out", str(tmp / f"{tag}-study"), "--steps", "1", "--seeds", "1"]),
        (f"{tag}:families", ["families", "discover", m]),
    ]


def test_hostile_sizes_are_one_line_in_every_command_and_nothing_is_built(tmp_path, models):
    cases = ("labels", "positions", "table")
    cmds = [c for case in cases for c in _commands(models[case], tmp_path, case)]
    # the control: the honest models go on to build (the counter counts)
    for family in ("gpt2", "gptj"):
        cmds.append(
            (f"control:{family}", ["convert", str(models[family]), str(tmp_path / f"ok-{family}"), "--no-verify"])
        )
    proc = checked_run(  # one child for all (a child's start-up is most of the cost on a loaded machine)
        [sys.executable, "-c", CHILD, json.dumps(cmds)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(REPO), "NORMSWAP_CPU_KERNEL": "0", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    needle = {
        "labels": "num_labels is 100,000,000",
        "positions": "n_positions is 200,000,000",
        "table": "position table",
    }
    for name, _ in cmds:
        code, err, built = results[name]
        case = name.split(":")[0]
        if case == "control" or name == "table:families":
            # `families discover` builds a tiny instance with normswap's own small sizes
            # (architectures/tiny.py shrinks positions too): it may run, inside the 2 GiB cap
            assert code == 0 and built > 0, (name, err[-800:])
            continue
        # the refusal is one error line (a command may first say what it starts: "normswap finetune: A -> B")
        lines = [ln for ln in err.splitlines() if "error:" in ln]
        assert code not in (0, 99) and built == 0 and "Traceback" not in err, (name, code, built, err[-800:])
        assert len(lines) == 1 and needle[case] in lines[0], (name, err[-800:])
    assert not any(p.name.endswith(("-conv", "-exp", "-ft")) for p in tmp_path.iterdir())


STUDY_CHILD = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # the config asks for terabytes: refuse within 2 GiB
from normswap.cli.main import main
main(sys.argv[1:])
"""


def test_a_config_alone_too_large_to_train_is_refused_before_anything_is_built(tmp_path):
    """Every size of this GPT-2 config is within its own cap (48 layers, 16,384 wide), but the model
    it builds has 155 billion parameters: the study counts them on the meta device and refuses in one
    line, inside a 2 GiB address-space cap, before DIR exists."""
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps(dict(model_type="gpt2", n_layer=48, n_embd=16384, n_head=16, vocab_size=4096)))
    out = tmp_path / "study"
    proc = checked_run(
        [sys.executable, "-c", STUDY_CHILD, "study", str(huge), "--out", str(out), "--steps", "1", "--seeds", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO), "NORMSWAP_CPU_KERNEL": "0", "OMP_NUM_THREADS": "1"},
    )
    lines = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-1500:]
    assert "arms of 154,7" in lines[0] and "nothing was built" in lines[0], lines[0]
    assert not out.exists()


def test_the_meta_count_is_the_built_models_and_a_small_study_fits():
    """Negative control: the meta-device count equals a real build's, and a small model passes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from normswap.study.preflight_checks import check_memory
    from normswap.study.training.arms import Source

    config = AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
    real = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert sizes.parameter_count(config, AutoModelForCausalLM) == real
    source = Source(spec="tiny.json", config=config, tokenizer=None, trained=None)
    assert check_memory(source, ["layernorm", "rmsnorm", "dyt"], "cpu") == real
    with pytest.raises(NormswapError, match="needs ~.* GiB but 0.0 GiB of memory is available"):
        sizes.check_fits(real * 52, 1000, "tiny.json", "training 3 arms")
