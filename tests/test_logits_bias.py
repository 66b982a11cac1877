"""A tied head's final-norm β folded through the head into a logits bias (issue #43, item 2).

logits = (n·γ + β)·Wᵀ = (n·γ)·Wᵀ + W·β: the causal LM's head holds b = W·β (float64) as its bias, so
its last norm runs no bias add of its own; β travels as ``folded_bias`` for the bare model and the
other heads, and training derives b from it. Real tiny randomised GPT-2 and OPT checkpoints (tied
heads, final LayerNorms with β), converted by `normswap convert`, loaded by stock transformers.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from helpers import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from normswap.compat import checks
from normswap.compat.rows import Row, all_rows, build_original
from normswap.compat.rows import convert as compat_convert
from normswap.convert import execute
from normswap.convert.pipeline import convert_checkpoint
from normswap.convert.plan import build_plan
from normswap.errors import VerificationError

# the checkpoints hold float32 roundings of float64 folds: compared in float64, the tests' existing
# tolerance for an exact conversion (tests/test_convert.py); a wrong fold misses by > 1e-2
TOL = 1e-5
NORM = {"gpt2": "transformer.ln_f", "opt": "model.decoder.final_layer_norm"}
NO_DROPOUT = {
    "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "opt": {"dropout": 0.0, "attention_dropout": 0.0},
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(source dir, converted dir, source model) per family and --beta choice, built once."""
    root = tmp_path_factory.mktemp("logits-bias")
    cache = {}

    def get(family, beta=None):
        if family not in cache:
            model = tiny_model(family, **NO_DROPOUT[family])
            model.save_pretrained(root / family)
            cache[family] = model
        key = (family, beta)
        if key not in cache:
            out = root / f"{family}-{beta or 'default'}"
            cache[key] = convert_checkpoint(str(root / family), str(out), **({"beta": beta} if beta else {}))
        return root / family, root / f"{family}-{beta or 'default'}", cache[family]

    return get


def _load(auto, directory, remote=True):
    return getattr(transformers, auto).from_pretrained(str(directory), trust_remote_code=remote, dtype=torch.float64)


def _ids(vocab, seed=1):
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))


def _logprobs(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.double().log_softmax(-1)


class _Reads(TorchDispatchMode):
    """The storages each aten op reads, recorded while ``active`` names a module that is running."""

    def __init__(self):
        super().__init__()
        self.active, self.ops = None, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.active is not None:
            ptrs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)}
            self.ops.setdefault(self.active, []).append((str(func), ptrs))
        return func(*args, **(kwargs or {}))


def _ops_inside(model, names, ids):
    """{module name: [(aten op, storages read)]} of one no-grad forward (float64: norms run as torch ops)."""
    mode = _Reads()
    handles = []
    for name in names:
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(lambda m, a, n=name: setattr(mode, "active", n)))
        handles.append(module.register_forward_hook(lambda m, a, o: setattr(mode, "active", None)))
    try:
        with torch.no_grad(), mode:
            model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return mode.ops


def _ptr(t):
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_tied_final_beta_becomes_the_logits_bias_and_the_conversion_stays_exact(family, pair):
    src, out, model = pair(family)
    norm_name = NORM[family]
    conversion = json.loads((out / "normswap_manifest.json").read_text())["conversion"]
    summary = conversion["summary"]
    assert summary["logits_bias"] == {"lm_head": norm_name}
    block = json.loads((out / "config.json").read_text())["normswap"]
    rec = block["norms"][norm_name]
    assert rec["gamma"] == "keep" and rec["beta"] == "fold" and rec["bias"] is False and rec["restore"] == ["bias"]
    assert any("logits bias" in n for n in conversion["notes"])
    assert f"lm_head.bias = W·β of {norm_name}" in (out / "README.md").read_text()  # the model card

    original, converted = _load("AutoModelForCausalLM", src, remote=False), _load("AutoModelForCausalLM", out)
    ids = _ids(model.config.vocab_size)
    assert float((_logprobs(converted, ids) - _logprobs(original, ids)).abs().max()) <= TOL

    head, norm = converted.lm_head, converted.get_submodule(norm_name)
    w, beta = original.lm_head.weight, original.get_submodule(norm_name).bias
    assert norm.bias is None and head.weight is converted.get_input_embeddings().weight
    assert torch.allclose(head.bias, (w.double() @ beta.double()), rtol=1e-6, atol=1e-7)  # stored in float32
    assert "lm_head.bias" not in dict(converted.named_parameters())  # derived from β, not a parameter of its own

    # what runs: the norm reads no β, and the head's bias is read by the op that reads W (addmm), no other
    ops = _ops_inside(converted, [norm_name, "lm_head"], ids)
    assert not [op for op, reads in ops[norm_name] if _ptr(norm.folded_bias) in reads]
    bias_readers = [op for op, reads in ops["lm_head"] if _ptr(head.bias) in reads]
    assert len(bias_readers) == 1 and any(_ptr(head.weight) in reads for _, reads in ops["lm_head"])
    assert [op for op, reads in ops["lm_head"] if _ptr(head.bias) in reads and _ptr(head.weight) in reads]

    # negative control: --beta keep, the earlier layout, is exact too but its last norm adds β itself
    _, kept_dir, _ = pair(family, "keep")
    kept = _load("AutoModelForCausalLM", kept_dir)
    kept_norm = kept.get_submodule(norm_name)
    assert kept_norm.bias is not None and getattr(kept.lm_head, "bias", None) is None
    assert float((_logprobs(kept, ids) - _logprobs(original, ids)).abs().max()) <= TOL
    kept_ops = _ops_inside(kept, [norm_name], ids)
    assert [op for op, reads in kept_ops[norm_name] if _ptr(kept_norm.bias) in reads]


def test_explicit_beta_fold_takes_the_same_path_and_approx_mode_too(pair, tmp_path):
    src, _, model = pair("gpt2")
    ids = _ids(model.config.vocab_size)
    original = _load("AutoModelForCausalLM", src, remote=False)
    explicit = convert_checkpoint(str(src), str(tmp_path / "fold"), beta="fold")
    assert explicit["logits_bias"] == {"lm_head": "transformer.ln_f"}
    # approx mode (no centring) folds it the same way: the final fold is algebra, exact in any mode
    approx = convert_checkpoint(str(src), str(tmp_path / "approx"), mode="approx", gamma="keep", verify=False)
    assert approx["logits_bias"] == {"lm_head": "transformer.ln_f"}
    a = _load("AutoModelForCausalLM", tmp_path / "approx")
    assert a.transformer.ln_f.bias is None and a.lm_head.bias.abs().max() > 0
    # (n·γ + β)·Wᵀ on the approx model's own final-norm input equals its logits
    captured = {}
    a.transformer.ln_f.register_forward_hook(lambda m, i, o: captured.setdefault("n", o))
    with torch.no_grad():
        logits = a(input_ids=ids).logits
    expected = (captured["n"] + original.transformer.ln_f.bias.double()) @ a.lm_head.weight.t()
    assert torch.allclose(logits, expected, atol=1e-6)


@pytest.mark.parametrize("wrong", ["omitted", "beta of another norm"])
def test_a_wrong_fold_fails_verification_and_nothing_is_published(pair, tmp_path, monkeypatch, wrong):
    """Negative control of the fold itself: convert's verification catches it, exit 1, no OUT."""
    src, _, _ = pair("gpt2")

    def broken(*args, **kwargs):  # the plan convert builds, with the fold's derivation made wrong
        plan = build_plan(*args, **kwargs)
        plan.derivations["lm_head.bias"]["beta"] = None if wrong == "omitted" else "transformer.h.0.ln_1.bias"
        return plan

    monkeypatch.setattr(execute, "build_plan", broken)
    with pytest.raises(VerificationError):
        convert_checkpoint(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


COMPAT_ROWS = {"gpt2": "transformer.ln_f", "mbart": "model.decoder.layer_norm"}


@pytest.mark.parametrize("name", list(COMPAT_ROWS))
def test_bare_model_and_every_other_head_read_the_original_hidden_states(tmp_path_factory, name):
    """The compat matrix's GPT-2 and MBart rows: every Auto class of the converted checkpoint gives the
    original's outputs (new heads initialised alike), the bare model's hidden states included. MBart's
    causal LM, loaded from the seq2seq checkpoint, initialises its tied matrix anew: its head derives
    W·β of that matrix at load, not the stored one. Control: without the record telling the bare
    model to add β, its hidden states are wrong."""
    from safetensors.torch import load_file

    row: Row = {r.name: r for r in all_rows()}[name]
    norm = COMPAT_ROWS[name]
    root = tmp_path_factory.mktemp(f"compat-{name}")
    build_original(row, root / "original")
    compat_convert(root / "original", root / "converted")
    cfg = json.loads((root / "converted" / "config.json").read_text())
    assert cfg["normswap"]["logits_bias"] == {"lm_head": norm}
    cell = checks.check_auto_classes(root / "original", root / "converted", row)
    assert cell.status == "ok", cell.detail
    assert {"AutoModel", "AutoModelForCausalLM"} <= set(cell.parts) and max(cell.parts.values()) <= 1e-5

    lm = _load("AutoModelForCausalLM", root / "converted")
    derived = (lm.lm_head.weight @ lm.get_submodule(norm).folded_bias).detach()
    assert torch.allclose(lm.lm_head.bias, derived, atol=1e-12)
    stored = load_file(str(next((root / "converted").glob("*.safetensors"))))["lm_head.bias"].double()
    if name == "mbart":  # the stored W·β is another matrix's: deriving it at load is what makes the cell ok
        assert float((stored - derived).abs().max()) > 1e-2

    ids = _ids(200)
    with torch.no_grad():
        ref = _load("AutoModel", root / "original", remote=False)(input_ids=ids).last_hidden_state
        got = _load("AutoModel", root / "converted")(input_ids=ids).last_hidden_state
    assert float((ref - got).abs().max()) <= TOL * float(ref.abs().max())
    broken = root / "broken"
    shutil.copytree(root / "converted", broken)
    cfg["normswap"]["norms"][norm].pop("restore")
    (broken / "config.json").write_text(json.dumps(cfg))
    with torch.no_grad():
        wrong = _load("AutoModel", broken)(input_ids=ids).last_hidden_state
    assert float((ref - wrong).abs().max()) > 1e-2 * float(ref.abs().max())


def test_training_gives_beta_and_w_the_original_gradients_and_a_save_holds_w_beta(pair, tmp_path):
    """In train mode the head computes W·β in the graph: β (``folded_bias``) and the tied W get the
    gradients the original's β and W get; after a step the stored bias is derived again, before a save
    (state-dict hook) and before the next forward without a gradient."""
    src, out, model = pair("gpt2")
    ids = _ids(model.config.vocab_size, seed=2)
    original, converted = _load("AutoModelForCausalLM", src, remote=False), _load("AutoModelForCausalLM", out)
    o_beta, c_beta = original.transformer.ln_f.bias, converted.transformer.ln_f.folded_bias
    o_w, c_w = original.transformer.wte.weight, converted.transformer.wte.weight
    assert isinstance(c_beta, torch.nn.Parameter)

    # negative control first: eval mode (the stored bias) gives β no gradient at all
    converted.eval()
    converted(input_ids=ids, labels=ids).loss.backward()
    assert c_beta.grad is None
    converted.zero_grad(set_to_none=True)

    original.train(), converted.train()
    original(input_ids=ids, labels=ids).loss.backward()
    converted(input_ids=ids, labels=ids).loss.backward()
    for mine, theirs in ((c_beta.grad, o_beta.grad), (c_w.grad, o_w.grad)):
        assert float((mine - theirs).abs().max()) <= TOL * float(theirs.abs().max())

    def step():  # the same SGD step on β and W in both
        with torch.no_grad():
            for p in (o_beta, c_beta, o_w, c_w):
                p -= 0.5 * p.grad
                p.grad = None
        original.eval(), converted.eval()
        assert not torch.allclose(converted.lm_head.bias, c_w @ c_beta)  # the stored bias is stale until derived

    step()
    assert float((_logprobs(converted, ids) - _logprobs(original, ids)).abs().max()) <= TOL  # derived in forward
    original.train(), converted.train()
    original(input_ids=ids, labels=ids).loss.backward()
    converted(input_ids=ids, labels=ids).loss.backward()
    step()
    converted.save_pretrained(tmp_path / "stepped")  # derived by the state-dict hook
    reloaded = _load("AutoModelForCausalLM", tmp_path / "stepped")
    assert float((_logprobs(reloaded, ids) - _logprobs(original, ids)).abs().max()) <= TOL


def test_resizing_the_vocabulary_derives_the_new_rows_bias(pair):
    _, out, model = pair("gpt2")
    converted = _load("AutoModelForCausalLM", out)
    n = model.config.vocab_size
    torch.manual_seed(0)
    converted.resize_token_embeddings(n + 8)
    w, beta = converted.lm_head.weight, converted.transformer.ln_f.folded_bias
    assert converted.lm_head.bias.shape == (n + 8,)
    expected = w.detach() @ beta.detach()
    assert expected[n:].abs().min() > 0  # transformers pads the bias with zeros: it must be derived
    assert torch.allclose(converted.lm_head.bias, expected, atol=1e-12)


def test_stock_export_puts_beta_back_on_the_final_norm(pair, tmp_path):
    """A stock GPT2LMHeadModel has no lm_head bias: the export puts β back on ln_f (the carried
    folded_bias), and the head's W·β is absorbed; the export is the original function."""
    from normswap.export import run_export

    src, out, model = pair("gpt2")
    record = run_export(out, tmp_path / "stock", "stock")
    assert record["verification"]["passed"] and record["folded_affine_moved"] == {"transformer.ln_f": "gamma_beta"}
    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "stock", dtype=torch.float64)
    original = _load("AutoModelForCausalLM", src, remote=False)
    assert stock.lm_head.bias is None
    assert torch.equal(stock.transformer.ln_f.bias, original.transformer.ln_f.bias)
    ids = _ids(model.config.vocab_size)
    assert float((_logprobs(stock, ids) - _logprobs(original, ids)).abs().max()) <= TOL
