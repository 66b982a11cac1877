"""Inputs checked against each other before anything is written: each file tensor used exactly once,
every weight present, shapes and dtypes plausible for their role; untrusted .bin files never unpickle code."""

import json
import pickle
import struct
from pathlib import Path

import pytest
import torch
from helpers import tiny_model
from safetensors import safe_open
from safetensors.torch import save_file


@pytest.fixture
def sharded_neox(tmp_path):
    src = tmp_path / "src"
    tiny_model("gpt_neox", 0).save_pretrained(src, max_shard_size="24KB")
    return src


def _refused(code, err, needle, tmp_path):
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.startswith("normswap: error:")]
    assert len(lines) == 1 and needle in lines[0], err
    assert "nothing was written" in lines[0] or "corrupted" in lines[0] or "absent" in lines[0], lines[0]
    # nothing written: no OUT, no staging directory
    assert [p.name for p in tmp_path.iterdir()] == ["src"], list(tmp_path.iterdir())


def _shard_with(src, key):
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            if key in h.keys():
                return f
    raise KeyError(key)


def _rewrite(path, change):
    with safe_open(str(path), "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_config_with_fewer_layers_than_the_weights_is_refused(sharded_neox, tmp_path, run_cli):
    cfg = json.loads((sharded_neox / "config.json").read_text())
    assert cfg["num_hidden_layers"] >= 2
    cfg["num_hidden_layers"] -= 1
    (sharded_neox / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli("convert", sharded_neox, tmp_path / "out", "--no-verify")
    _refused(code, err, "have no place", tmp_path)
    assert f"layers.{cfg['num_hidden_layers']}." in err  # names the first extra tensor


def test_config_with_more_layers_than_the_weights_is_refused(sharded_neox, tmp_path, run_cli):
    cfg = json.loads((sharded_neox / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (sharded_neox / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli("convert", sharded_neox, tmp_path / "out", "--no-verify")
    _refused(code, err, f"num_hidden_layers is {cfg['num_hidden_layers']} but the weights hold at most", tmp_path)


def test_missing_tensor_is_refused_not_invented(sharded_neox, tmp_path, run_cli):
    key = "gpt_neox.layers.1.mlp.dense_h_to_4h.weight"
    _rewrite(_shard_with(sharded_neox, key), lambda t: t.pop(key))
    index = sharded_neox / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"][key]
    index.write_text(json.dumps(data))
    code, _, err = run_cli("convert", sharded_neox, tmp_path / "out", "--no-verify")
    _refused(code, err, "lacks 1 tensor", tmp_path)
    assert key in err


def test_extra_tensor_is_refused(sharded_neox, tmp_path, run_cli):
    path = _shard_with(sharded_neox, "gpt_neox.final_layer_norm.weight")
    _rewrite(path, lambda t: t.__setitem__("gpt_neox.layers.0.attention.extra.weight", torch.zeros(4)))
    code, _, err = run_cli("convert", sharded_neox, tmp_path / "out", "--no-verify")
    _refused(code, err, "gpt_neox.layers.0.attention.extra.weight", tmp_path)


def test_float32_bytes_relabelled_as_int32_are_refused(sharded_neox, tmp_path, run_cli):
    """Same byte count, so the file itself is valid safetensors: only the role says it is wrong."""
    key = "gpt_neox.layers.0.attention.dense.weight"
    path = _shard_with(sharded_neox, key)
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert header[key]["dtype"] == "F32"
    header[key]["dtype"] = "I32"
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    assert len(text) == n
    path.write_bytes(bytes(raw[:8]) + text + bytes(raw[8 + n :]))
    with safe_open(str(path), "pt") as h:  # a valid file as far as safetensors can tell
        assert h.get_tensor(key).dtype == torch.int32
    code, _, err = run_cli("convert", sharded_neox, tmp_path / "out", "--no-verify")
    _refused(code, err, "stored as int32", tmp_path)
    assert key in err


def test_wrong_shape_is_refused(sharded_neox, tmp_path, run_cli):
    key = "gpt_neox.layers.0.attention.dense.bias"
    _rewrite(_shard_with(sharded_neox, key), lambda t: t.__setitem__(key, torch.zeros(t[key].numel() + 1)))
    code, _, err = run_cli("convert", sharded_neox, tmp_path / "out", "--no-verify")
    _refused(code, err, "shape", tmp_path)


def test_tied_duplicates_that_differ_are_refused(tmp_path, run_cli):
    """A tied GPT-2 saved with its head too: equal copies convert, different ones are refused."""
    src = tmp_path / "src"
    model = tiny_model("gpt2", 0)
    model.save_pretrained(src)
    path = src / "model.safetensors"
    _rewrite(path, lambda t: t.__setitem__("lm_head.weight", t["transformer.wte.weight"].clone()))
    code, _, err = run_cli("convert", src, tmp_path / "ok", "--no-verify")
    assert code == 0, err
    import shutil

    shutil.rmtree(tmp_path / "ok")
    _rewrite(path, lambda t: t.__setitem__("lm_head.weight", t["transformer.wte.weight"] + 1))
    code, _, err = run_cli("convert", src, tmp_path / "out", "--no-verify")
    _refused(code, err, "differ", tmp_path)


def test_truncated_shard(sharded_neox, tmp_path, run_cli):
    shard = sorted(sharded_neox.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    code, _, err = run_cli("convert", sharded_neox, tmp_path / "out")
    _refused(code, err, "corrupted safetensors", tmp_path)
    assert shard.name in err


def test_shard_listed_in_index_but_absent(sharded_neox, tmp_path, run_cli):
    sorted(sharded_neox.glob("model-*.safetensors"))[0].unlink()
    code, _, err = run_cli("convert", sharded_neox, tmp_path / "out")
    _refused(code, err, "absent", tmp_path)


def test_bin_checkpoint_converts_and_a_malicious_one_runs_no_code(tmp_path, run_cli):
    src = tmp_path / "src"
    model = tiny_model("gpt2", 0)
    model.config.save_pretrained(src)
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    code, out, err = run_cli("convert", src, tmp_path / "out", "--json")
    assert code == 0, err
    assert json.loads(out)["source_format"] == "bin" and json.loads(out)["verification"]["passed"] is True

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.write_text, (marker, "ran"))

    evil = tmp_path / "evil"
    model.config.save_pretrained(evil)
    with open(evil / "pytorch_model.bin", "wb") as f:
        pickle.dump({"transformer.wte.weight": Evil()}, f)
    code, _, err = run_cli("convert", evil, tmp_path / "evil_out")
    assert code == 2 and "not a plain PyTorch weights file" in err and "Traceback" not in err
    assert not marker.exists() and not (tmp_path / "evil_out").exists()
