"""Streaming conversion: bitwise equal to the in-memory path, refuses what it cannot do, stays lean."""

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from normswap.convert import streaming
from normswap.convert.pipeline import convert_checkpoint
from normswap.errors import NormswapError
from normswap.testing import tiny_model



def _save(model, path, *, shard="24KB", dtype=None):
    """A stock LayerNorm checkpoint split across several safetensors files."""
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path, max_shard_size=shard)
    return path


def _tensors(directory):
    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[k] = (f.name, h.get_tensor(k))
    return out


def _data_section(path):
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return header, raw[8 + n:]


def assert_same_checkpoint(a, b):
    """Same files, same index, same config and code; every tensor: same key, file, dtype and bits."""
    a, b = Path(a), Path(b)
    weights = sorted(p.name for p in a.glob("*.safetensors"))
    assert weights == sorted(p.name for p in b.glob("*.safetensors"))
    for name in ("config.json", "modeling_normswap.py", "model.safetensors.index.json", "generation_config.json"):
        assert (a / name).exists() == (b / name).exists(), name
        if (a / name).exists():
            assert (a / name).read_text() == (b / name).read_text(), name
    ta, tb = _tensors(a), _tensors(b)
    assert list(ta) and sorted(ta) == sorted(tb)
    for key, (file_a, x) in ta.items():
        file_b, y = tb[key]
        assert file_a == file_b, key
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), f"{key} differs"
    for name in weights:  # the data sections, not just the values, are byte-identical
        assert _data_section(a / name) == _data_section(b / name), name


def _both(src, tmp_path, **kw):
    mem = convert_checkpoint(src, tmp_path / "mem", streaming=False, verify=False, **kw)
    st = convert_checkpoint(src, tmp_path / "stream", streaming=True, verify=False, **kw)
    assert mem["path"] == "in-memory" and st["path"] == "streaming"
    return mem, st


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    # tiny models: make every matrix go through the piece-wise code paths
    monkeypatch.setattr(streaming, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(streaming, "ADAPTIVE_WHOLE", False)


CASES = [
    # (family, variant, options)
    ("gpt2", 0, {}),  # tied head: centring at run time, head absent on disk
    ("gpt2", 0, {"untie": True}),  # untied: the head is derived from the embedding
    ("gpt2", 0, {"mode": "approx"}),
    ("gpt_neox", 0, {}),  # untied; lm_head is `embed_out` on disk
    ("gpt_neox", 0, {"dtype": "bfloat16", "max_shard_size": "30KB"}),
    ("bloom", 0, {}),
    ("falcon", 1, {}),  # new decoder architecture: ln_attn / ln_mlp
    ("opt", 0, {"untie": True}),
    ("gptj", 0, {"mode": "approx"}),
    ("bert", 0, {}),  # post-LN: approx; decoder bias tied, absent on disk
]


@pytest.mark.parametrize("family,variant,opts", CASES, ids=[f"{f}-{v}-{'-'.join(o) or 'default'}" for f, v, o in CASES])
def test_streaming_equals_in_memory(family, variant, opts, tmp_path):
    src = _save(tiny_model(family, variant), tmp_path / "src")
    assert len(list(src.glob("*.safetensors"))) > 2  # really sharded
    opts = {"max_shard_size": "40KB", **opts}
    mem, st = _both(src, tmp_path, **opts)
    assert_same_checkpoint(tmp_path / "mem", tmp_path / "stream")
    for field in ("mode", "norms_replaced", "gamma", "beta", "added_biases", "untied", "parameters_before", "parameters_after"):
        assert mem[field] == st[field], field
    manifest = json.loads((tmp_path / "stream" / "normswap_manifest.json").read_text())
    assert manifest["conversion"]["path"] == "streaming"


def test_load_dtype_cast_is_reproduced(tmp_path):
    """float32 files under a bfloat16 config, written as float16: two roundings, in that order.

    The in-memory path loads the float32 tensors as bfloat16 (dtype="auto" follows the config),
    so the streaming path must round to bfloat16 before its float64 math; the negative control
    skips that rounding and must differ.
    """
    src = _save(tiny_model("gpt_neox", 0), tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (src / "config.json").write_text(json.dumps(cfg))
    _both(src, tmp_path, dtype="float16", max_shard_size="40KB")
    assert_same_checkpoint(tmp_path / "mem", tmp_path / "stream")
    assert all(t.dtype == torch.float16 for _, t in _tensors(tmp_path / "stream").values())

    original = streaming._Converter.loaded

    def no_load_cast(self, key, start=None, stop=None):
        return self.source.read(self.disk_key(key), start, stop)

    streaming._Converter.loaded = no_load_cast
    try:
        convert_checkpoint(src, tmp_path / "wrong", streaming=True, verify=False, dtype="float16", max_shard_size="40KB")
    finally:
        streaming._Converter.loaded = original
    with pytest.raises(AssertionError):
        assert_same_checkpoint(tmp_path / "mem", tmp_path / "wrong")


def test_comparison_detects_one_flipped_bit(tmp_path):
    """Negative control for assert_same_checkpoint itself."""
    src = _save(tiny_model("gpt2", 0), tmp_path / "src")
    _both(src, tmp_path)
    shard = sorted((tmp_path / "stream").glob("*.safetensors"))[0]
    header, _ = _data_section(shard)
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8 + n + 5] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(AssertionError):
        assert_same_checkpoint(tmp_path / "mem", tmp_path / "stream")


def test_streaming_with_verification(tmp_path):
    src = _save(tiny_model("gpt_neox", 0), tmp_path / "src")
    result = convert_checkpoint(src, tmp_path / "out", streaming=True)
    assert result["path"] == "streaming"
    assert result["verification"]["passed"] is True
    assert result["verification"]["max_abs_diff"] <= result["verification"]["threshold"]


def test_verification_that_would_not_fit_is_refused_up_front(tmp_path, monkeypatch):
    src = _save(tiny_model("gpt2", 0), tmp_path / "src")
    monkeypatch.setattr(streaming, "_available_memory", lambda: 10_000)
    with pytest.raises(NormswapError, match="--no-verify"):
        convert_checkpoint(src, tmp_path / "out", streaming=True)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # no staging leftovers
    convert_checkpoint(src, tmp_path / "out", streaming=True, verify=False)
    assert (tmp_path / "out" / "config.json").exists()


# -- bad inputs: the same behaviour as the in-memory path ----------------------------------------

@pytest.fixture
def sharded_gpt2(tmp_path):
    return _save(tiny_model("gpt2", 0), tmp_path / "src")


def _only_src_left(tmp_path):
    return [p.name for p in tmp_path.iterdir()] == ["src"]


def test_truncated_shard(sharded_gpt2, tmp_path, run_cli):
    shard = sorted(sharded_gpt2.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    code, out, err = run_cli("convert", sharded_gpt2, tmp_path / "out", "--streaming")
    assert code == 2
    assert "corrupted safetensors" in err and shard.name in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert _only_src_left(tmp_path)


def test_missing_tensor_is_refused_not_invented(sharded_gpt2, tmp_path):
    shard = sorted(sharded_gpt2.glob("model-*.safetensors"))[-1]
    with safe_open(str(shard), "pt") as h:
        kept = {k: h.get_tensor(k) for k in h.keys()}
    dropped = sorted(kept)[0]
    del kept[dropped]
    save_file(kept, str(shard), metadata={"format": "pt"})
    with pytest.raises(NormswapError, match="lacks 1 tensor"):
        convert_checkpoint(sharded_gpt2, tmp_path / "out", streaming=True, verify=False)
    assert _only_src_left(tmp_path)


def test_shard_listed_in_index_but_absent(sharded_gpt2, tmp_path):
    sorted(sharded_gpt2.glob("model-*.safetensors"))[0].unlink()
    with pytest.raises(NormswapError, match="absent"):
        convert_checkpoint(sharded_gpt2, tmp_path / "out", streaming=True, verify=False)
    assert _only_src_left(tmp_path)


def test_out_exists_is_refused_and_force_replaces(sharded_gpt2, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(NormswapError, match="already exists"):
        convert_checkpoint(sharded_gpt2, out, streaming=True, verify=False)
    assert (out / "keep.txt").read_text() == "mine"
    convert_checkpoint(sharded_gpt2, out, streaming=True, verify=False, force=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()


def test_bin_checkpoint(tmp_path, run_cli):
    src = tmp_path / "src"
    model = tiny_model("gpt2", 0)
    model.config.save_pretrained(src)  # transformers 5 saves only safetensors: write the .bin ourselves
    torch.save({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, src / "pytorch_model.bin")
    code, out, err = run_cli("convert", src, tmp_path / "out", "--streaming", "--no-verify")
    assert code == 2 and "safetensors" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    # automatic choice: falls back to the in-memory path
    result = convert_checkpoint(src, tmp_path / "out", verify=False)
    assert result["path"] == "in-memory"


def test_automatic_choice_by_size(sharded_gpt2, tmp_path, monkeypatch):
    monkeypatch.delenv(streaming.THRESHOLD_ENV, raising=False)
    assert streaming.should_stream(str(sharded_gpt2), True, None) is False  # a few hundred KB
    assert convert_checkpoint(sharded_gpt2, tmp_path / "a", verify=False)["path"] == "in-memory"
    monkeypatch.setenv(streaming.THRESHOLD_ENV, "100KB")  # smaller than this checkpoint
    assert streaming.should_stream(str(sharded_gpt2), True, None) is True
    assert convert_checkpoint(sharded_gpt2, tmp_path / "b", verify=False)["path"] == "streaming"
    assert convert_checkpoint(sharded_gpt2, tmp_path / "c", verify=False, streaming=False)["path"] == "in-memory"


# -- memory: measured in a child process ---------------------------------------------------------

# Anonymous memory (RssAnon), sampled every 2 ms: what the conversion itself holds. Total RSS
# also counts file-backed pages of the memory-mapped source and of the output being filled in
# place; those are page cache the kernel reclaims at will, and how many stay resident depends on
# writeback timing and on what else the machine is doing (a full test run: +500 MB).
_CHILD = textwrap.dedent("""
    import json, sys, threading, time
    import torch, transformers
    from normswap.checkpoint.load import load_config
    from normswap.convert.pipeline import convert_checkpoint, meta_model

    def anon():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    src, out, shard, streaming = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
    meta_model(load_config(src))  # imports the modeling code (~200 MB of modules), not part of the data
    baseline = anon()
    peak = [baseline]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    convert_checkpoint(src, out, streaming=streaming, verify=False, max_shard_size=shard)
    done.set()
    t.join()
    peak[0] = max(peak[0], anon())
    print(json.dumps({"baseline": baseline, "peak": peak[0]}))
""")


def _convert_in_child(src, out, shard, streaming_flag):
    env = dict(os.environ, NORMSWAP_KERNEL="torch", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(out), str(shard), "1" if streaming_flag else "0"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_memory_stays_near_a_shard_not_the_model(tmp_path):
    """A ~370 MB checkpoint in 4 shards: streaming grows anonymous memory by < 2 shards; in memory by > the model."""
    from normswap.convert.bench import family_config, synthetic_checkpoint

    config = family_config("gpt_neox", 1024, 6, vocab=8192)
    info = synthetic_checkpoint(tmp_path / "src", config=config, shards=4, dtype="fp32", family="gpt_neox")
    model_bytes, shard = info["bytes"], info["largest_shard_bytes"]
    assert model_bytes > 300e6 and shard < model_bytes / 3

    st = _convert_in_child(tmp_path / "src", tmp_path / "stream", shard, True)
    growth = st["peak"] - st["baseline"]
    assert growth < 2 * shard, f"streaming grew anonymous memory by {growth / 1e6:.0f} MB (largest shard {shard / 1e6:.0f} MB)"
    assert growth < model_bytes / 2

    # negative control: the same measurement sees the in-memory path hold the whole model
    mem = _convert_in_child(tmp_path / "src", tmp_path / "mem", shard, False)
    assert mem["peak"] - mem["baseline"] > model_bytes
    assert_same_checkpoint(tmp_path / "mem", tmp_path / "stream")
