"""One conversion path: every source gives the same bits; the precision policy; pass-through copies."""

import json
import struct
from pathlib import Path

import pytest
import torch
from helpers import tiny_model
from safetensors import safe_open

from normswap.checkpoint.shards import INDEX_NAME
from normswap.convert import execute, ops
from normswap.convert.apply import convert_model
from normswap.convert.pipeline import convert_checkpoint


def _save(model, path, *, shard="24KB", dtype=None):
    """A stock LayerNorm checkpoint split across several safetensors files."""
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path, max_shard_size=shard)
    return path


def _save_bin(model, path):
    """The same checkpoint as a PyTorch .bin (transformers 5 writes only safetensors)."""
    model.config.save_pretrained(path)
    torch.save(model.state_dict(), path / "pytorch_model.bin")
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
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return header, raw[8 + n :]


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same_checkpoint(a, b):
    """Same files, same index, same config and code; every tensor: same key, file, dtype and bits."""
    a, b = Path(a), Path(b)
    weights = sorted(p.name for p in a.glob("*.safetensors"))
    assert weights == sorted(p.name for p in b.glob("*.safetensors"))
    for name in ("modeling_normswap.py", INDEX_NAME):
        assert (a / name).exists() == (b / name).exists(), name
        if (a / name).exists():
            assert (a / name).read_text() == (b / name).read_text(), name
    config_a, config_b = (json.loads((d / "config.json").read_text()) for d in (a, b))
    config_a.pop("_name_or_path", None)
    config_b.pop("_name_or_path", None)
    assert config_a == config_b
    ta, tb = _tensors(a), _tensors(b)
    assert list(ta) and sorted(ta) == sorted(tb)
    for key, (file_a, x) in ta.items():
        file_b, y = tb[key]
        assert file_a == file_b, key
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert torch.equal(_bits(x), _bits(y)), f"{key} differs"
    for name in weights:  # the data sections, not just the values, are byte-identical
        assert _data_section(a / name) == _data_section(b / name), name


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    # tiny models: make every matrix go through several row blocks
    monkeypatch.setattr(ops, "BLOCK_ELEMENTS", 1024)


CASES = [
    # (family, variant, options)
    ("gpt2", 0, {}),  # tied head: centring at run time, head absent on disk; Conv1D layout
    ("gpt2", 0, {"untie": True}),  # untied: the head is derived from the embedding
    ("gpt_neox", 0, {"dtype": "bfloat16"}),  # untied; lm_head is `embed_out` on disk; 16-bit arithmetic
    ("bloom", 0, {}),
    ("falcon", 1, {}),  # new decoder architecture: ln_attn / ln_mlp
    ("bert", 0, {}),  # post-LN: approx; decoder bias tied, absent on disk
]


@pytest.mark.parametrize("family,variant,opts", CASES, ids=[f"{f}-{v}-{'-'.join(o) or 'default'}" for f, v, o in CASES])
def test_every_source_gives_the_same_bits(family, variant, opts, tmp_path):
    """Sharded safetensors, a .bin and an in-memory model convert to bitwise-identical tensors."""
    model = tiny_model(family, variant)
    files = _save(model, tmp_path / "st")
    assert len(list(files.glob("*.safetensors"))) > 2  # really sharded
    st = convert_checkpoint(files, tmp_path / "from_st", verify=False, max_shard_size="40KB", **opts)
    binary = convert_checkpoint(
        _save_bin(model, tmp_path / "bin"), tmp_path / "from_bin", verify=False, max_shard_size="40KB", **opts
    )
    assert st["source_format"] == "safetensors" and binary["source_format"] == "bin"
    assert_same_checkpoint(tmp_path / "from_st", tmp_path / "from_bin")
    for field in (
        "mode",
        "norms_replaced",
        "gamma",
        "beta",
        "added_biases",
        "untied",
        "parameters_before",
        "parameters_after",
    ):
        assert st[field] == binary[field], field

    # the Python API on a live model: the same tensors
    opts = {k: v for k, v in opts.items() if k != "max_shard_size"}
    dtype = getattr(torch, opts.pop("dtype")) if "dtype" in opts else None
    convert_model(model, dtype=dtype, **opts)
    written = _tensors(tmp_path / "from_st")
    live = model.state_dict()
    assert set(written) <= set(live)
    for key, (_, t) in written.items():
        assert torch.equal(_bits(t), _bits(live[key])), key


def test_comparison_detects_one_flipped_bit(tmp_path):
    """Negative control for assert_same_checkpoint itself."""
    src = _save(tiny_model("gpt2", 0), tmp_path / "src")
    for name in ("a", "b"):
        convert_checkpoint(src, tmp_path / name, verify=False)
    assert_same_checkpoint(tmp_path / "a", tmp_path / "b")
    shard = sorted((tmp_path / "b").glob("*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8 + n + 5] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(AssertionError):
        assert_same_checkpoint(tmp_path / "a", tmp_path / "b")


def test_results_do_not_depend_on_threads_or_blocks_for_row_ops(tmp_path, monkeypatch):
    """One worker or many: the same bits (each tensor's arithmetic is single-threaded)."""
    src = _save(tiny_model("gpt_neox", 0), tmp_path / "src")
    convert_checkpoint(src, tmp_path / "many", verify=False, dtype="bfloat16")
    monkeypatch.setattr(execute, "default_workers", lambda: 1)
    convert_checkpoint(src, tmp_path / "one", verify=False, dtype="bfloat16")
    assert_same_checkpoint(tmp_path / "many", tmp_path / "one")


def test_load_dtype_cast_comes_first(tmp_path):
    """float32 files under a bfloat16 config: values are rounded to bfloat16 (what from_pretrained(dtype="auto")
    holds) before any arithmetic; the negative control converts the same files without that rounding."""
    src = _save(tiny_model("gpt_neox", 0), tmp_path / "src")
    plain = convert_checkpoint(src, tmp_path / "plain", verify=False, dtype="float32")
    cfg = json.loads((src / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (src / "config.json").write_text(json.dumps(cfg))
    convert_checkpoint(src, tmp_path / "cast", verify=False, dtype="float32")
    assert plain["parameters_after"] > 0
    a, b = _tensors(tmp_path / "plain"), _tensors(tmp_path / "cast")
    key = "gpt_neox.layers.0.attention.dense.weight"
    assert a[key][1].dtype == b[key][1].dtype == torch.float32
    assert not torch.equal(a[key][1], b[key][1])
    # with the rounding first, the centred weight is (bf16 values) - (their column mean), in float64
    w = _source_tensor(src, key).to(torch.bfloat16).double()
    assert torch.equal(b[key][1], (w - w.mean(dim=0, keepdim=True)).float())


def _source_tensor(src, key):
    for f in sorted(Path(src).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            if key in h.keys():
                return h.get_tensor(key)
    raise KeyError(key)


# -- precision policy ------------------------------------------------------------------------


def _ulps(a, b):
    """Distance in units in the last place of a's dtype (16-bit: bit patterns are monotone per sign)."""
    ia = a.view(torch.int16).to(torch.int32)
    ib = b.view(torch.int16).to(torch.int32)
    # map sign-magnitude to a monotone integer line
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return (ia - ib).abs()


def test_16_bit_outputs_match_the_float64_path_to_one_ulp(tmp_path):
    """bf16 output: float32 element-wise arithmetic (float64 reductions) against all-float64.

    Almost every element is identical and none is more than one ulp away; the negative control
    (arithmetic in bfloat16 itself) is far worse.
    """
    from normswap.architectures import family_for_config
    from normswap.checkpoint.tensor_source import StateDict
    from normswap.convert.config import ConvertOptions
    from normswap.convert.tensor_match import match

    model = tiny_model("gpt_neox", 0, hidden_size=256, intermediate_size=1024).to(torch.bfloat16)
    sd = {k: v.clone() for k, v in model.state_dict().items()}

    def run(compute):
        m = tiny_model("gpt_neox", 0, hidden_size=256, intermediate_size=1024).to(torch.bfloat16)
        m.load_state_dict(sd)
        inputs = match(m, StateDict(m.state_dict()), "m")
        conv = execute.prepare(m, inputs, family_for_config(m.config), ConvertOptions(mode="exact"))
        sink = execute.TensorDict(conv.specs)
        execute.execute(conv, sink, compute=compute)
        return {k: v for k, v in sink.tensors.items() if k in conv.plan.derivations}

    fast, ref, coarse = run(None), run(torch.float64), run(torch.bfloat16)
    total = sum(t.numel() for t in ref.values())
    differ = sum(int((_ulps(fast[k], ref[k]) > 0).sum()) for k in ref)
    worst = max(int(_ulps(fast[k], ref[k]).max()) for k in ref)
    assert total > 500_000
    assert worst <= 1 and differ / total < 1e-3, (differ, total, worst)
    coarse_differ = sum(int((_ulps(coarse[k], ref[k]) > 0).sum()) for k in ref)
    assert coarse_differ > 10 * max(differ, 1)


def test_float32_outputs_use_float64_arithmetic(tmp_path):
    """float32 output: the default is the float64 path, bit for bit; float32 arithmetic would differ."""
    src = _save(tiny_model("gpt_neox", 0), tmp_path / "src")
    convert_checkpoint(src, tmp_path / "default", verify=False)
    a = _tensors(tmp_path / "default")
    key = "gpt_neox.layers.0.attention.dense.weight"
    w = _source_tensor(src, key).double()
    assert torch.equal(a[key][1], (w - w.mean(dim=0, keepdim=True)).float())
    w32 = _source_tensor(src, key)
    assert not torch.equal(a[key][1], w32 - w32.mean(dim=0, keepdim=True))


def test_pass_through_tensors_are_copied_byte_for_byte(tmp_path, monkeypatch):
    """Approx mode with γ and β kept: the weights that no op touches go file to file, never cast."""
    from normswap.checkpoint import shards

    src = _save(tiny_model("gpt_neox", 0), tmp_path / "src", dtype=torch.bfloat16)
    copied = []
    original = shards.ShardWriter.copy

    def spy(self, key, *args):
        copied.append(key)
        return original(self, key, *args)

    monkeypatch.setattr(shards.ShardWriter, "copy", spy)
    convert_checkpoint(src, tmp_path / "out", verify=False, mode="approx", gamma="keep", beta="keep")
    out = _tensors(tmp_path / "out")
    assert (
        "gpt_neox.layers.0.mlp.dense_4h_to_h.weight" in copied and "gpt_neox.layers.0.input_layernorm.weight" in copied
    )
    disk = _tensors(src)
    disk["lm_head.weight"] = disk.pop("embed_out.weight")  # GPT-NeoX's head is saved under its old name
    for key in copied:
        assert torch.equal(_bits(out[key][1]), _bits(disk[key][1])), key


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_arithmetic_matches_cpu_to_one_ulp(tmp_path):
    src = _save(tiny_model("gpt_neox", 0), tmp_path / "src", dtype=torch.bfloat16)
    convert_checkpoint(src, tmp_path / "cpu", verify=False)
    res = convert_checkpoint(src, tmp_path / "gpu", verify=True, device="cuda")
    assert res["verification"]["passed"] is True
    a, b = _tensors(tmp_path / "cpu"), _tensors(tmp_path / "gpu")
    for key in a:
        assert int(_ulps(a[key][1], b[key][1]).max()) <= 1, key


def test_rounding_floor_weights_are_the_written_ones_before_rounding(tmp_path):
    """bf16 output: the weights verification uses for the rounding floor are the conversion's own float32
    results before the final cast, so rounding them gives the written tensors bit for bit; float64
    arithmetic (what the floor used before) would not."""
    from normswap.architectures import family_for_config
    from normswap.checkpoint.tensor_source import StateDict
    from normswap.convert.config import ConvertOptions
    from normswap.convert.pipeline import unrounded_tensor
    from normswap.convert.tensor_match import match

    m = tiny_model("gpt_neox", 0, hidden_size=256, intermediate_size=1024).to(torch.bfloat16)
    inputs = match(m, StateDict(m.state_dict()), "m")
    conv = execute.prepare(m, inputs, family_for_config(m.config), ConvertOptions(mode="exact"))
    sink = execute.TensorDict(conv.specs)
    execute.execute(conv, sink)
    computed = [k for k, w in conv.writes.items() if w.value_key in conv.plan.derivations and w.dtype == torch.bfloat16]
    assert len(computed) > 10
    float64_differs = 0
    for key in computed:
        exact = unrounded_tensor(conv, key)
        assert exact.dtype == torch.float32
        assert torch.equal(_bits(exact.to(torch.bfloat16)), _bits(sink.tensors[key])), key
        sink64 = execute.TensorDict({key: (torch.float64, conv.writes[key].shape)})
        ops.run(
            conv.plan.derivations[conv.writes[key].value_key],
            conv.writes[key].shape,
            inputs.read,
            lambda k: inputs.specs[k][1],
            lambda t, row, sink64=sink64, key=key: sink64.write(key, t, row),
            torch.float64,
        )
        float64_differs += int((sink64.tensors[key] != exact.double()).sum())
    assert float64_differs > 0  # control: the float64 path's unrounded values are not the same numbers


@pytest.mark.parametrize(
    "family,opts",
    [("gpt2", {"untie": True}), ("gpt_neox", {"dtype": "bfloat16"}), ("bloom", {})],
    ids=["gpt2-conv1d-untied", "gpt_neox-bf16", "bloom-fp32"],
)
def test_bias_summed_in_the_weight_pass_gives_the_same_bits(family, opts, tmp_path, monkeypatch):
    """W·β summed from the row blocks the weight's own pass reads (one read of W) = a separate pass over W."""
    src = _save(tiny_model(family, 0), tmp_path / "src")
    seen = []
    fused_biases = execute.fused_biases

    def spy(*args, **kwargs):
        seen.append(fused_biases(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(execute, "fused_biases", spy)
    convert_checkpoint(src, tmp_path / "fused", verify=False, **opts)
    assert len(seen[0]) >= 2  # control: the fusion happened (every γ/β-folding reader)
    monkeypatch.setattr(execute, "fused_biases", lambda *a, **k: {})
    convert_checkpoint(src, tmp_path / "separate", verify=False, **opts)
    assert_same_checkpoint(tmp_path / "fused", tmp_path / "separate")


def test_row_blocks_on_a_pool_give_the_same_bits(tmp_path):
    """Verification recomputes (and reads) tensors with their row blocks on several threads: the same
    bits as one block after another, sums over blocks included (fused W·β, column means)."""
    from concurrent.futures import ThreadPoolExecutor

    from normswap.architectures import family_for_config
    from normswap.checkpoint.tensor_source import StateDict
    from normswap.convert.config import ConvertOptions
    from normswap.convert.pipeline import unrounded_tensor
    from normswap.convert.tensor_match import match

    m = tiny_model("gpt_neox", 0, hidden_size=256, intermediate_size=1024).to(torch.bfloat16)
    inputs = match(m, StateDict(m.state_dict()), "m")
    conv = execute.prepare(m, inputs, family_for_config(m.config), ConvertOptions(mode="exact"))
    computed = [k for k, w in conv.writes.items() if w.value_key in conv.plan.derivations]
    assert any(len(ops.row_blocks(conv.writes[k].shape)) > 4 for k in computed)  # really several blocks
    with ThreadPoolExecutor(max_workers=3) as pool:
        for key in computed:
            alone = unrounded_tensor(conv, key)
            assert torch.equal(_bits(unrounded_tensor(conv, key, pool=pool)), _bits(alone)), key
            out = torch.empty_like(alone)
            assert (
                torch.equal(_bits(unrounded_tensor(conv, key, pool=pool, out=out)), _bits(alone))
                and out.data_ptr() != alone.data_ptr()
            )
        for key in list(inputs.specs)[:20]:
            if inputs.disk_key(key) is not None and inputs.specs[key][0].is_floating_point:
                assert torch.equal(inputs.read_as(key, torch.float32, pool=pool), inputs.read_as(key, torch.float32)), (
                    key
                )
