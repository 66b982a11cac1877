"""`normswap export`: a converted checkpoint in its source's stock architecture, and as ONNX.

Each export is compared with what a user would compare it with: the original (stock LayerNorm)
model and the converted one, loaded as a user loads them; each test has a control that a wrong
export fails.
"""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from helpers import family_variants, tiny_model
from helpers import without_centring as _rms_swapped
from transformers import AutoModelForCausalLM

from normswap.assets.models import model_path


def _logprobs(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.double().log_softmax(-1)


def _ids(vocab, seed=1):
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))


def _tree_digest(path):
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Tiny sources (stock LayerNorm checkpoints) and their exact conversions, written once."""
    from normswap.convert.pipeline import convert_checkpoint

    root = tmp_path_factory.mktemp("export-sources")
    cache = {}

    def get(family, variant=0, **convert_options):
        key = (family, variant, tuple(sorted(convert_options.items())))
        if key not in cache:
            src = root / f"src-{family}-{variant}"
            if family == "kjv-gpt2":  # real weights and a real tokenizer
                src = model_path("kjv-gpt2")
            elif not src.exists():
                tiny_model(family, variant).save_pretrained(src)
            out = root / f"conv-{family}-{len(cache)}"
            convert_checkpoint(str(src), out, **convert_options)
            cache[key] = (src, out)
        return cache[key]

    return get


# ------------------------------------------------------------------------------------- stock
def test_stock_export_is_the_original_function_in_stock_transformers(converted, tmp_path, run_cli):
    src, out = converted("kjv-gpt2")
    dest = tmp_path / "stock"
    code, stdout, stderr = run_cli("export", out, dest, "--format", "stock", "--json")
    assert code == 0, stderr
    record = json.loads(stdout)
    assert record["verification"]["passed"] and record["verification"]["dtype"] == "float64"

    # stock files: the source's model_type and class, no remote code, stock weight name, tokenizer
    cfg = json.loads((dest / "config.json").read_text())
    assert cfg["model_type"] == "gpt2" and cfg["architectures"] == ["GPT2LMHeadModel"]
    assert "auto_map" not in cfg and "normswap" not in cfg
    assert (dest / "model.safetensors").is_file() and not list(dest.glob("*.py"))
    assert (dest / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()

    stock = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()  # no trust_remote_code
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    assert type(stock) is type(original)
    assert not any("RMSNorm" in type(m).__name__ for m in stock.modules())
    assert stock.lm_head.weight is stock.transformer.wte.weight  # tie kept: no extra parameters
    ids = _ids(stock.config.vocab_size)
    assert float((_logprobs(stock, ids) - _logprobs(original, ids)).abs().max()) <= 1e-4
    # the weights are the converted ones: γ = 1 and β = 0 where the conversion folded them
    ln = stock.transformer.h[0].ln_1
    assert torch.equal(ln.weight, torch.ones_like(ln.weight)) and torch.equal(ln.bias, torch.zeros_like(ln.bias))

    # control: the tied table is not centred (its centring ran at run time), so the stream is not
    # zero-mean and RMSNorm in place of these LayerNorms is another function; the record says so
    assert record["rmsnorm_ready"] is False and record["not_centred"][0]["module"] == "transformer.wte"
    assert float((_logprobs(_rms_swapped(stock), ids) - _logprobs(original, ids)).abs().max()) > 1e-2


def test_stock_untie_centres_the_table_so_rmsnorm_is_the_same_function(converted, tmp_path, run_cli):
    src, out = converted("kjv-gpt2")
    dest = tmp_path / "stock"
    code, stdout, stderr = run_cli("export", out, dest, "--format", "stock", "--untie", "--json")
    assert code == 0, stderr
    record = json.loads(stdout)
    assert record["rmsnorm_ready"] is True and record["centred_in_weights"] == ["transformer.wte.weight"]
    stock = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    assert stock.lm_head.weight is not stock.transformer.wte.weight
    table = stock.transformer.wte.weight
    assert float(table.mean(-1).abs().max()) < 1e-6  # centred rows
    assert torch.equal(stock.lm_head.weight, original.lm_head.weight)  # the head keeps the original table
    ids = _ids(stock.config.vocab_size)
    assert float((_logprobs(stock, ids) - _logprobs(original, ids)).abs().max()) <= 1e-4
    assert float((_logprobs(_rms_swapped(stock), ids) - _logprobs(original, ids)).abs().max()) <= 1e-4
    # the publishing check again through the API (what the compatibility matrix calls); the original
    # passes it too (the same function); control: a copy of the export with one γ doubled fails it
    import shutil

    from safetensors.torch import load_file, save_file

    from normswap.export import verify_export

    assert verify_export(out, dest, "stock")["passed"] and verify_export(src, dest, "stock")["passed"]
    wrong = tmp_path / "wrong"
    shutil.copytree(dest, wrong)
    tensors = load_file(wrong / "model.safetensors")
    tensors["transformer.h.0.ln_1.weight"] = tensors["transformer.h.0.ln_1.weight"] * 2
    save_file(tensors, wrong / "model.safetensors", metadata={"format": "pt"})
    assert not verify_export(out, wrong, "stock")["passed"]


def test_stock_export_that_differs_is_not_published(converted, tmp_path, run_cli, monkeypatch):
    """Control for the verification itself: γ written as 0 instead of 1 must fail it, and DEST stays absent."""
    from normswap.export import stock

    _, out = converted("kjv-gpt2")
    real = stock.StockPlan.value

    def wrong(self, opened, key):
        t = real(self, opened, key)
        return torch.zeros_like(t) if self.fill.get(key) == "ones" else t

    monkeypatch.setattr(stock.StockPlan, "value", wrong)
    dest = tmp_path / "stock"
    code, _, stderr = run_cli("export", out, dest, "--format", "stock")
    assert code == 1 and "verification failed" in stderr and "nothing was written" in stderr
    assert not dest.exists() and not list(tmp_path.glob(".stock*staging*"))


_PRE_LN = {}  # curated family -> its first pre-LN test config
for _fam, _variant in family_variants(placement="pre"):
    _PRE_LN.setdefault(_fam, _variant)


@pytest.mark.parametrize("family", sorted(_PRE_LN))
def test_every_curated_family_exports_stock_with_default_options(family, converted, tmp_path):
    """`normswap convert SRC OUT && normswap export OUT DEST --format stock`, default options, for every
    curated pre-LN family (post-LN ones convert approximately: test_stock_refuses_an_approximate_conversion):
    DEST loads in plain transformers (no remote code) and gives the converted model's log-probs; where
    the conversion folded β into a linear that has no bias in the stock class (GPT-NeoX's lm_head,
    GPT-J's q/k/v...), that β is back in the norm."""
    import normswap
    from normswap.export import run_export

    src, out = converted(family, _PRE_LN[family])
    block = json.loads((out / "config.json").read_text())["normswap"]
    assert block["mode"] == "exact"
    record = run_export(out, tmp_path / "stock", "stock")
    dest = Path(record["out"])
    assert "auto_map" not in json.loads((dest / "config.json").read_text()) and not list(dest.glob("*.py"))
    stock = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()
    assert not any("RMSNorm" in type(m).__name__ for m in stock.modules())
    conv = normswap.load_model(out)
    ids = _ids(stock.config.vocab_size)
    assert float((_logprobs(stock, ids) - _logprobs(conv, ids)).abs().max()) <= 1e-4
    assert record["verification"]["passed"]  # float64 where the modeling code runs in it (not XGLM's)
    # every bias the conversion added sits where the stock class has one, or went back into its norm
    stock_keys = set(stock.state_dict())
    for reader in block["added_biases"]:
        assert f"{reader}.bias" in stock_keys or any(
            reader in rec["readers"] and name in record["folded_affine_moved"] for name, rec in block["norms"].items()
        )


def test_stock_export_puts_folded_beta_back_into_the_norm(converted, tmp_path):
    """GPT-NeoX: ln_f's γ/β were folded into lm_head, which has no bias in the stock class; the export
    gives the stock final LayerNorm its γ and β back and lm_head its original weight, so the bare model
    (AutoModel, which never sees the head) returns the original's hidden states too. Control: the same
    export with the moved β left out (what dropping the homeless bias would give) fails verification."""
    from transformers import AutoModel

    from normswap.errors import VerificationError
    from normswap.export import affine, run_export

    src, out = converted("gpt_neox")
    record = run_export(out, tmp_path / "stock", "stock")
    assert record["folded_affine_moved"]["gpt_neox.final_layer_norm"] == "gamma_beta"
    assert record["verification"]["passed"] and record["rmsnorm_ready"]
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "stock", dtype=torch.float32).eval()
    ln, ln0 = stock.gpt_neox.final_layer_norm, original.gpt_neox.final_layer_norm
    assert torch.allclose(ln.weight, ln0.weight) and torch.allclose(ln.bias, ln0.bias)
    assert torch.allclose(stock.lm_head.weight, original.lm_head.weight, atol=1e-6)
    ids = _ids(stock.config.vocab_size)
    with torch.no_grad():
        h = AutoModel.from_pretrained(tmp_path / "stock", dtype=torch.float32).eval()(input_ids=ids)
        h0 = AutoModel.from_pretrained(src, dtype=torch.float32).eval()(input_ids=ids)
    assert float((h.last_hidden_state - h0.last_hidden_state).abs().max()) <= 1e-4

    real = affine.move_folded_affine

    def without_bias(*args, **kwargs):
        moved = real(*args, **kwargs)
        moved.values = {
            k: (torch.zeros_like(v) if k.endswith("layer_norm.bias") else v) for k, v in moved.values.items()
        }
        return moved

    import normswap.export.stock as stock_module

    stock_module.move_folded_affine, saved = without_bias, stock_module.move_folded_affine
    try:
        with pytest.raises(VerificationError, match="nothing was written"):
            run_export(out, tmp_path / "wrong", "stock")
    finally:
        stock_module.move_folded_affine = saved
    assert not (tmp_path / "wrong").exists()


def test_stock_refuses_only_where_no_stock_form_exists(converted, tmp_path, run_cli, capsys):
    """GPT-J's q/k/v have no bias; with γ_j = 0 and β_j ≠ 0 on ln_1, W·β has a part no LayerNorm bias
    can reach (W′'s column j is zero), so export refuses in one line, naming the tensor and the option
    that avoids it. Controls: the same source with --gamma keep --beta keep exports, and so does the
    default conversion when β_j is 0 too."""
    from normswap.convert.pipeline import convert_checkpoint

    model = tiny_model("gptj")
    with torch.no_grad():
        model.transformer.h[0].ln_1.weight[5] = 0.0
        model.transformer.h[0].ln_1.bias[5] = 0.7
    src = tmp_path / "src"
    model.save_pretrained(src)
    convert_checkpoint(str(src), tmp_path / "conv")  # exact: γ_j = 0 folds fine
    capsys.readouterr()  # the writes' progress bars
    code, _, stderr = run_cli("export", tmp_path / "conv", tmp_path / "stock", "--format", "stock")
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "transformer.h.0.attn." in stderr and "γ of transformer.h.0.ln_1 is 0" in stderr
    assert "--gamma keep --beta keep" in stderr and not (tmp_path / "stock").exists()

    convert_checkpoint(str(src), tmp_path / "kept", gamma="keep", beta="keep")
    code, _, stderr = run_cli("export", tmp_path / "kept", tmp_path / "stock", "--format", "stock")
    assert code == 0, stderr
    with torch.no_grad():
        model.transformer.h[0].ln_1.bias[5] = 0.0
    model.save_pretrained(tmp_path / "src0")
    convert_checkpoint(str(tmp_path / "src0"), tmp_path / "conv0")
    code, _, stderr = run_cli("export", tmp_path / "conv0", tmp_path / "stock0", "--format", "stock")
    assert code == 0, stderr


def test_stock_refuses_an_approximate_conversion(converted, tmp_path, run_cli, capsys):
    """Post-LN: the RMSNorms read a stream that is not zero-mean, so a LayerNorm there is another
    function: refused in one line (control: that LayerNorm really differs)."""
    import normswap

    _, out = converted("opt", 1)  # OPT with do_layer_norm_before=False: converted approximately
    capsys.readouterr()  # the fixture's progress bars, when it wrote the conversion just now
    code, _, stderr = run_cli("export", out, tmp_path / "stock", "--format", "stock")
    assert code == 2 and "converted approximately" in stderr and len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "stock").exists()

    model = normswap.load_model(out)
    ids = _ids(model.config.vocab_size)
    want = _logprobs(model, ids)
    for name, module in list(model.named_modules()):
        if type(module).__name__ == "RMSNorm":
            ln = torch.nn.LayerNorm(module.hidden_size, eps=module.eps)
            with torch.no_grad():
                ln.weight.copy_(module.weight if module.weight is not None else torch.ones(module.hidden_size))
                ln.bias.copy_(module.bias if module.bias is not None else torch.zeros(module.hidden_size))
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, ln)
    assert float((_logprobs(model, ids) - want).abs().max()) > 1e-2


def test_bad_input_one_line_and_nothing_lost(converted, tmp_path, run_cli):
    src, out = converted("opt")
    before = _tree_digest(out)
    cases = {
        "not converted": ((src, tmp_path / "a"), "is not a checkpoint normswap converted"),
        "DEST is OUT": ((out, out), "overlaps the checkpoint"),
        "DEST inside OUT": ((out, out / "sub"), "overlaps the checkpoint"),
        "OUT inside DEST": ((out, out.parent), "overlaps the checkpoint"),
    }
    for name, ((a, b), message) in cases.items():
        code, _, stderr = run_cli("export", a, b, "--format", "stock", "--force")
        assert code == 2 and message in stderr, (name, stderr)
        assert len(stderr.strip().splitlines()) == 1, (name, stderr)
    assert _tree_digest(out) == before
    assert not (tmp_path / "a").exists() and not (out / "sub").exists()


# -------------------------------------------------------------------------------------- onnx
@pytest.fixture(scope="module")
def onnx_exports(converted, tmp_path_factory):
    """The KJV GPT-2 (real weights and tokenizer) and its conversion, each exported to ONNX once."""
    from normswap.export import run_export

    root = tmp_path_factory.mktemp("onnx")
    src, out = converted("kjv-gpt2")
    exports = {
        name: (path, run_export(path, root / name, "onnx")) for name, path in (("original", src), ("converted", out))
    }
    # the portable form: ONNX's own RMSNormalization, which onnxruntime does not fuse with the residual Add
    # (the forward alone: the generation graph's own checks are the other two exports' and test_onnx_generate's)
    exports["converted-rms"] = (
        out,
        run_export(out, root / "converted-rms", "onnx", norm_op="rmsnormalization", with_past=False),
    )
    return exports


def _set_rms_epsilon(path, eps):
    import onnx

    proto = onnx.load(str(path))
    for node in proto.graph.node:
        if node.op_type == "RMSNormalization":
            for attr in node.attribute:
                if attr.name == "epsilon":
                    attr.f = eps
    onnx.save(proto, str(path))


def test_onnx_export_runs_the_original_function_with_rmsnormalization(onnx_exports):
    from normswap.export.onnx import is_onnx_dir, run_session, session

    (src, original), (_, converted) = onnx_exports["original"], onnx_exports["converted"]
    _, portable = onnx_exports["converted-rms"]
    # one norm node per RMSNorm, nothing left of the custom kernel: by default onnxruntime's
    # SkipSimplifiedLayerNormalization (every pre-LN norm here follows a residual Add), in the portable
    # form ONNX's opset-23 RMSNormalization; the original keeps LayerNormalization
    norms = 2 * json.loads((src / "config.json").read_text())["n_layer"] + 1
    assert converted["norm_nodes"] == {"SkipSimplifiedLayerNormalization": norms} and converted["opset"] == 23
    assert portable["norm_nodes"] == {"RMSNormalization": norms}
    assert original["norm_nodes"] == {"LayerNormalization": norms}
    assert is_onnx_dir(converted["out"]) and (Path(converted["out"]) / "tokenizer.json").is_file()

    # what a user compares: onnxruntime on each converted graph against PyTorch on the original model
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = _ids(model.config.vocab_size)
    longer = _ids(model.config.vocab_size, seed=2)[:1, :17]
    for export in (converted, portable):
        assert export["verification"]["passed"] and export["verification"]["max_abs_diff"] <= 1e-4
        got = run_session(session(Path(export["out"]) / "model.onnx"), ids).double().log_softmax(-1)
        assert float((got - _logprobs(model, ids)).abs().max()) <= 1e-4
        # dynamic shapes: another batch and length than the trace's
        shape = run_session(session(Path(export["out"]) / "model.onnx"), longer).shape
        assert shape == (1, 17, model.config.vocab_size)


def test_onnxruntime_runs_the_converted_norms_fused_at_least_as_often_as_the_original(onnx_exports, tmp_path):
    """#37: in the graph onnxruntime actually runs (its optimised graph, written by the session), the
    converted export holds at least as many fused norm ops (Add folded in: Skip*) as the original.
    Negative controls: the export patterns used before (ONNX's RMSNormalization; the contrib
    SimplifiedLayerNormalization without the Add folded in) fuse fewer than the original."""
    import onnx

    from normswap.export.onnx import fuse_residual_adds, optimised_norm_ops

    def fused(graph, name):
        ops = optimised_norm_ops(graph, tmp_path, name)
        return sum(n for op, n in ops.items() if op.startswith("Skip"))

    counts = {name: fused(Path(rec["out"]) / "model.onnx", name) for name, (_, rec) in onnx_exports.items()}
    assert counts["original"] >= 1  # onnxruntime fuses some of the original's LayerNorms (the final one)
    assert counts["converted"] >= counts["original"]
    assert counts["converted-rms"] < counts["original"]
    # the old "simplified" export: the same graph with each Skip op split back into Add + norm
    proto = onnx.load(str(Path(onnx_exports["converted"][1]["out"]) / "model.onnx"))
    _unfuse(proto)
    unfused = tmp_path / "unfused.onnx"
    onnx.save(proto, str(unfused))
    assert fused(unfused, "unfused") < counts["original"]
    # and the pass itself fuses it again
    assert fuse_residual_adds(proto) == onnx_exports["converted"][1]["norm_nodes"]["SkipSimplifiedLayerNormalization"]


def _unfuse(proto):
    """Each SkipSimplifiedLayerNormalization back into Add + SimplifiedLayerNormalization (the pattern
    `export --onnx-norm-op simplified` wrote before #37)."""
    from onnx import helper

    nodes = []
    for node in proto.graph.node:
        if node.op_type == "SkipSimplifiedLayerNormalization":
            total = node.output[3] if len(node.output) > 3 and node.output[3] else node.name + "_sum"
            eps = next(helper.get_attribute_value(a) for a in node.attribute if a.name == "epsilon")
            nodes.append(helper.make_node("Add", [node.input[0], node.input[1]], [total]))
            nodes.append(
                helper.make_node(
                    "SimplifiedLayerNormalization", [total, node.input[2]], [node.output[0]], axis=-1, epsilon=eps
                )
            )
        else:
            nodes.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)


def test_onnx_validation_catches_a_wrong_epsilon(onnx_exports, tmp_path, monkeypatch):
    """Control for the validation: the same graph with ε = 1 in its RMSNormalization nodes fails it,
    through the command (nothing published) and through validate() on a copy of the good graph."""
    import shutil

    import normswap
    from normswap.errors import VerificationError
    from normswap.export import onnx as onnx_export
    from normswap.export import run_export

    _, converted = onnx_exports["converted-rms"]
    bad = tmp_path / "bad.onnx"
    shutil.copy(Path(converted["out"]) / "model.onnx", bad)
    _set_rms_epsilon(bad, 1.0)
    model = normswap.load_model(converted["source"])
    assert onnx_export.validate(model, Path(converted["out"]) / "model.onnx", None, tolerance=1e-4)["passed"]
    assert not onnx_export.validate(model, bad, None, tolerance=1e-4)["passed"]
    from normswap.export import verify_export

    assert verify_export(converted["source"], converted["out"], "onnx")["passed"]

    def wrong_eps(model, path, **kwargs):  # the good graph (traced above) with ε = 1: no second trace
        shutil.copy(bad, path)
        return dict(converted["norm_nodes"])

    from normswap.export import onnx_generate

    monkeypatch.setattr(onnx_export, "export_graph", wrong_eps)
    monkeypatch.setattr(onnx_generate, "export_graph_with_cache", wrong_eps)  # the graph is a generation graph
    with pytest.raises(VerificationError, match="ONNX validation failed"):
        run_export(converted["source"], tmp_path / "dest", "onnx", norm_op="rmsnormalization")
    assert not (tmp_path / "dest").exists()


def test_onnx_without_its_packages_says_how_to_install(converted, tmp_path, run_cli, monkeypatch):
    import importlib.util

    _, out = converted("kjv-gpt2")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    code, _, stderr = run_cli("export", out, tmp_path / "onnx", "--format", "onnx")
    assert code == 2 and "pip install 'normswap[onnx]'" in stderr and "onnxruntime" in stderr
    assert len(stderr.strip().splitlines()) == 1 and not (tmp_path / "onnx").exists()
    # control: with the package found, the same command goes past the check
    monkeypatch.setattr(importlib.util, "find_spec", real)
    from normswap.export.onnx import require_packages

    require_packages()


def test_eval_speed_times_onnx_exports_beside_pytorch(onnx_exports, run_cli, tmp_path):
    (src, original), (_, converted) = onnx_exports["original"], onnx_exports["converted"]
    code, stdout, stderr = run_cli(
        "eval",
        "speed",
        f"orig={original['out']}",
        f"conv={converted['out']}",
        f"pt={src}",
        "--baseline",
        "orig",
        "--repeats",
        "2",
        "--min-time",
        "0.01",
        "--warmup",
        "1",
        "--seq-len",
        "16",
        "--new-tokens",
        "2",
        "--json",
        "--quiet",
    )
    assert code == 0, stderr
    rows = {m["name"]: m for m in json.loads(stdout)["models"]}
    for name in ("orig", "conv"):  # ONNX: forward only, and the rest reported as not measured, not as zero
        assert rows[name]["tokens_per_second"]["forward"] > 0
        assert "train_step" not in rows[name]["tokens_per_second"] and rows[name]["peak_memory_bytes"] is None
    assert rows["conv"]["ratios"]["tokens_per_second"]["forward"] > 0
    # control: the PyTorch model in the same run is timed on everything
    assert rows["pt"]["tokens_per_second"]["train_step"] > 0 and rows["pt"]["peak_memory_bytes"] > 0

    # lm-eval drives a PyTorch model: refused for an ONNX export, in one line
    code, _, stderr = run_cli(
        "eval",
        "report",
        original["out"],
        "--tasks",
        "normswap_kjv",
        "--no-speed",
        "--out",
        str(tmp_path / "r"),
        "--quiet",
    )
    assert (
        code == 2
        and "not by tasks" in stderr
        and not (tmp_path / "r").exists()
        and len(stderr.strip().splitlines()) == 1
    ), stderr


def test_eval_ppl_of_onnx_exports_is_the_pytorch_models(onnx_exports, run_cli):
    """`normswap eval ppl` reads the graph's logits through PyTorch's perplexity code: an exact conversion's
    graph gives the original's perplexity (the negative control, a different model's weights through the same
    code, is test_evaluate_onnx_perplexity.py's)."""
    (src, original), (_, converted) = onnx_exports["original"], onnx_exports["converted"]
    args = ["--max-tokens", "600", "--seq-len", "64", "--stride", "32", "--json", "--quiet"]
    code, stdout, stderr = run_cli(
        "eval", "ppl", f"pt={src}", f"orig={original['out']}", f"conv={converted['out']}", *args
    )
    assert code == 0, stderr
    rows = {m["name"]: m for m in json.loads(stdout)["models"]}
    assert rows["orig"]["perplexity_detail"] == rows["pt"]["perplexity_detail"] | {
        "nll_nats": rows["orig"]["perplexity_detail"]["nll_nats"]
    }
    for name in ("orig", "conv"):
        assert rows[name]["perplexity"] == pytest.approx(rows["pt"]["perplexity"], rel=1e-4)


def test_onnx_export_prints_no_exporter_chatter(converted, tmp_path, capfd):
    """What a user sees of `export --format onnx`: our lines only; the exporter's registry warnings
    (one per torchvision op when torchvision is absent), its Python warnings and its stdout progress
    are kept from them, and the summary prints no Python dict."""
    import logging
    import warnings

    from normswap.cli.main import main
    from normswap.export.onnx_graph import exporter_quiet as _exporter_quiet

    class Seen(logging.Handler):  # torch's log handler writes to a stream captured before the test
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    exporter_log, seen = logging.getLogger("torch.onnx"), Seen()
    exporter_log.addHandler(seen)
    try:
        _, out = converted("kjv-gpt2")
        capfd.readouterr()
        try:
            main(["export", str(out), str(tmp_path / "onnx"), "--format", "onnx"])
        except SystemExit as e:
            assert not e.code
        stdout, stderr = capfd.readouterr()
        assert not [line for line in seen.lines if "torchvision" in line], seen.lines
        assert all(line.startswith("normswap export: ") for line in stderr.strip().splitlines()), stderr
        assert "norm nodes: 9 SkipSimplifiedLayerNormalization" in stdout and "{" not in stdout, stdout

        # the silencer itself, and its control: the same log line and warning outside it do come out
        registry = logging.getLogger("torch.onnx._internal.exporter._registration")
        seen.lines.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with _exporter_quiet():
                registry.warning("torchvision is not installed. Skipping torchvision::nms")
                warnings.warn("exporter internals", UserWarning, stacklevel=1)
                print("exporter progress")
        assert not seen.lines and not caught and "exporter progress" not in capfd.readouterr().out
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            registry.warning("torchvision is not installed. Skipping torchvision::nms")
            warnings.warn("exporter internals", UserWarning, stacklevel=1)
        assert len(seen.lines) == 1 and len(caught) == 1
    finally:
        exporter_log.removeHandler(seen)


def test_stock_export_of_a_bfloat16_checkpoint_is_held_to_its_rounding_floor(tmp_path, monkeypatch):
    """γ/β moved back into the norms are computed in float64 and stored in bfloat16: that rounding moves
    the log-probs by itself (≈3e-3 here), so the threshold is 4x the measured rounding floor, as in
    convert. Control: the moved β left out is still refused (its error is far above the floor)."""
    from normswap.convert.pipeline import convert_checkpoint
    from normswap.errors import VerificationError
    from normswap.export import affine, run_export

    tiny_model("gpt_neox").to(torch.bfloat16).save_pretrained(tmp_path / "src")
    convert_checkpoint(str(tmp_path / "src"), tmp_path / "conv")
    record = run_export(tmp_path / "conv", tmp_path / "stock", "stock")
    ver = record["verification"]
    assert ver["passed"] and ver["rounding_floor"] > 0 and ver["threshold"] == max(1e-4, 4 * ver["rounding_floor"])

    real = affine.move_folded_affine

    def without_bias(*args, **kwargs):
        moved = real(*args, **kwargs)
        moved.values = {
            k: (torch.zeros_like(v) if k.endswith("layer_norm.bias") else v) for k, v in moved.values.items()
        }
        return moved

    import normswap.export.stock as stock_module

    monkeypatch.setattr(stock_module, "move_folded_affine", without_bias)
    with pytest.raises(VerificationError, match="nothing was written"):
        run_export(tmp_path / "conv", tmp_path / "wrong", "stock")
