"""#56 item 1: `normswap export --format onnx` writes a graph that generates (past key/values in,
present out, dynamic batch and lengths), and greedy generation through it gives PyTorch's tokens.

A tiny GPT-NeoX (rotary positions, parallel residual, untied head) converted exactly: its graph with
the cache against PyTorch's generate on the converted model and on the original; the same export
without the cache as the negative control of every readiness check. The KJV models and a sliced
model are covered by test_export.py / test_slice_checkpoint.py (their exports check generation too)
and by the committed run in results/onnx-generate-*/.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import tiny_model

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

NEW = 64


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    """(original dir, converted dir, {"past": record, "no-past": record}): a tiny GPT-NeoX converted and
    exported with its cache, and a tiny GPT-2 converted and exported --no-past (today's forward-only graph;
    GPT-NeoX's forward-only graph does not run in onnxruntime, a known exporter fault: docs/export.md)."""
    from normswap.checkpoint.manifest import read_manifest
    from normswap.convert.pipeline import convert_checkpoint
    from normswap.export import export_onnx_with_cache, run_export

    root = tmp_path_factory.mktemp("onnx-generate")
    # a context of 128: 16 prompt tokens + 64 new ones fit (the export's own check generates 64)
    tiny_model("gpt_neox", max_position_embeddings=128, bos_token_id=1, eos_token_id=2).save_pretrained(root / "src")
    convert_checkpoint(str(root / "src"), root / "conv")
    past = export_onnx_with_cache(root / "conv", root / "past")
    records = {"past": {**read_manifest(past)["export"], "out": str(past)}}
    tiny_model("gpt2").save_pretrained(root / "gpt2")
    convert_checkpoint(str(root / "gpt2"), root / "gpt2-conv")
    records["no-past"] = run_export(root / "gpt2-conv", root / "no-past", "onnx", with_past=False)
    return root / "src", root / "conv", records


def _prompt(vocab, batch=3, length=5, seed=7):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_generation_graph_gives_pytorchs_greedy_tokens(neox):
    """Another batch and prompt length than the export's check: the graph's tokens are PyTorch's, for the
    converted model and for the original (an exact conversion generates the same text), and the per-step
    API's logits are PyTorch's at every step. Controls: a step on an emptied cache is not PyTorch's, and the
    check fails against a perturbed model."""
    import normswap
    from normswap.export import OnnxGenerator, is_generation_ready
    from normswap.export.onnx_generate import check_generation, torch_greedy

    src, conv, records = neox
    rec = records["past"]
    assert rec["with_past"] and rec["generation"]["identical"] and rec["generation"]["new_tokens"] == NEW
    assert rec["inputs"][:4] == ["input_ids", "attention_mask", "position_ids", "past_key_values.0.key"]
    assert rec["outputs"][:3] == ["logits", "present.0.key", "present.0.value"]
    out = Path(rec["out"])
    assert is_generation_ready(out / "model.onnx") == (True, "")
    genai = json.loads((out / "genai_config.json").read_text())["model"]["decoder"]
    assert genai["inputs"]["past_key_names"] == "past_key_values.%d.key" and genai["num_hidden_layers"] == 2

    converted, original = normswap.load_model(conv), normswap.load_model(src)
    prompt = _prompt(converted.config.vocab_size)
    gen = OnnxGenerator(out)
    got = gen.generate(prompt.numpy(), NEW)
    want = torch_greedy(converted, prompt, NEW).numpy()
    assert got.shape == (3, 5 + NEW) and np.array_equal(got, want)
    assert np.array_equal(torch_greedy(original, prompt, NEW).numpy(), got)

    # prefill / decode_step: the logits PyTorch gives for the same tokens, step by step
    seq = torch.from_numpy(got)
    with torch.no_grad():
        full = converted(input_ids=seq).logits
    logits = gen.prefill(prompt.numpy())
    for step in range(6):
        assert np.abs(logits - full[:, 4 + step].numpy()).max() < 1e-4
        logits = gen.decode_step(got[:, 5 + step])
    assert gen.length == 5 + 6
    # control: a random tiny model's greedy text soon repeats a token, so the logits are the sharper check:
    # the same step on an emptied cache is not PyTorch's (the step reads the cache)
    gen.past = {name: np.zeros_like(t) for name, t in gen.past.items()}
    assert np.abs(gen.decode_step(got[:, 11]) - full[:, 11].numpy()).max() > 1e-3

    # control: against a model whose head is perturbed, the same graph's tokens differ and the check says where
    with torch.no_grad():
        head = converted.get_output_embeddings().weight
        head.add_(torch.randn_like(head) * 0.5)
    bad = check_generation(converted, out, prompt, 16, tie=1e-4)
    assert not bad["passed"] and bad["first_difference"]["top2_logprob_gap"] > 1e-4


def test_a_graph_without_the_cache_is_not_generation_ready(neox, tmp_path):
    """is_generation_ready on the --no-past graph (today's forward-only export) and on copies of the cache
    graph with one part of the cache removed or a length fixed; the generate loop refuses them in one line.
    Control: the cache graph itself is ready."""
    import onnx

    from normswap.errors import NormswapError
    from normswap.export import OnnxGenerator, is_generation_ready

    _, _, records = neox
    plain = Path(records["no-past"]["out"])
    assert records["no-past"]["with_past"] is False and records["no-past"]["inputs"] == ["input_ids"]
    assert "generation" not in records["no-past"] and not (plain / "genai_config.json").exists()
    ready, why = is_generation_ready(plain / "model.onnx")
    assert not ready and "no past key/values" in why
    with pytest.raises(NormswapError, match="cannot generate: the graph takes no past"):
        OnnxGenerator(plain)

    good = Path(records["past"]["out"]) / "model.onnx"
    assert is_generation_ready(good) == (True, "")

    def edited(name, edit):
        proto = onnx.load(str(good), load_external_data=False)
        edit(proto.graph)
        path = tmp_path / f"{name}.onnx"
        onnx.save(proto, str(path))
        return path

    def drop_output(graph):
        kept = [o for o in graph.output if o.name != "present.1.value"]
        del graph.output[:]
        graph.output.extend(kept)

    def fix_batch(graph):
        graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1

    assert is_generation_ready(edited("no-present", drop_output)) == (False, "the graph has no present.1.value output")
    assert is_generation_ready(edited("fixed", fix_batch)) == (False, "input_ids has a fixed batch or length")
    (tmp_path / "junk.onnx").write_bytes(b"not a graph")
    assert not is_generation_ready(tmp_path / "junk.onnx")[0]


def test_the_generation_graph_runs_as_a_forward(neox):
    """The generation graph run as a forward (an empty cache: what `bench onnx` and `eval speed` feed it)
    gives PyTorch's logits; control: another prompt's logits are not these."""
    import normswap
    from normswap.export.onnx import run_session, session

    _, conv, records = neox
    sess = session(Path(records["past"]["out"]) / "model.onnx")
    ids = _prompt(256, batch=2, length=9)
    with torch.no_grad():
        want = normswap.load_model(conv)(input_ids=ids).logits
    got = run_session(sess, ids)
    assert got.shape == (2, 9, 256) and float((got - want).abs().max()) < 1e-4
    assert float((run_session(sess, _prompt(256, batch=2, length=9, seed=8)) - want).abs().max()) > 1e-2


def test_onnxruntime_genai_generates_the_same_tokens(neox):
    """onnxruntime-genai (the stock runtime chosen, docs/export.md) reads genai_config.json and generates
    PyTorch's tokens from the same graph. Control: a prompt of other tokens gives other tokens."""
    og = pytest.importorskip("onnxruntime_genai")
    import normswap
    from normswap.export.onnx_generate import torch_greedy

    _, conv, records = neox
    model = og.Model(str(records["past"]["out"]))

    def generate(prompt):
        params = og.GeneratorParams(model)
        total = prompt.shape[1] + NEW
        params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=prompt.shape[0])
        gen = og.Generator(model, params)
        gen.append_tokens(prompt.numpy().astype(np.int32))
        while not gen.is_done():
            gen.generate_next_token()
        return np.stack([np.asarray(gen.get_sequence(i), dtype=np.int64) for i in range(prompt.shape[0])])

    prompt = _prompt(256)
    got = generate(prompt)
    assert np.array_equal(got, torch_greedy(normswap.load_model(conv), prompt, NEW).numpy())
    assert not np.array_equal(generate(_prompt(256, seed=9))[:, 5:], got[:, 5:])


def test_bad_input_is_one_line_and_writes_nothing(neox, tmp_path, run_cli, monkeypatch, capsys):
    """--with-past where no generation graph can be: a masked LM, --format stock, a cache that does not
    trace (forced); each one line, exit 2, DEST absent. Control: the same trace failure without
    --with-past falls back to the forward-only graph, says so, and records it."""
    from normswap.errors import NormswapError
    from normswap.export import onnx_generate

    src, conv, records = neox
    tiny_model("bert", task="masked-lm").save_pretrained(tmp_path / "bert")
    capsys.readouterr()  # the write's progress bar
    cases = [
        ((tmp_path / "bert", "--format", "onnx", "--with-past"), "is not a causal language model"),
        ((conv, "--format", "stock", "--with-past"), "--with-past is an option of --format onnx"),
    ]

    def untraceable(*args, **kwargs):
        raise NormswapError("torch.onnx.export could not trace X with its key/value cache: forced")

    monkeypatch.setattr(onnx_generate, "export_graph_with_cache", untraceable)
    cases.append(((conv, "--format", "onnx", "--with-past"), "could not trace X with its key/value cache"))
    for i, ((model, *options), message) in enumerate(cases):
        dest = tmp_path / f"dest{i}"
        code, out, err = run_cli("export", model, dest, *options)
        # progress lines ("normswap export: tracing ...") may come first; the refusal is one line
        errors = [line for line in err.splitlines() if line.strip() and not line.startswith("normswap")]
        errors += [line for line in err.splitlines() if line.startswith("normswap: error:")]
        assert code == 2 and len(errors) == 1 and message in errors[0], (options, err)
        assert not dest.exists() and not out

    from normswap.export import onnx as plain

    def copied(model, path, **kwargs):  # the forward-only graph already traced: no second trace
        shutil.copy(Path(records["no-past"]["out"]) / "model.onnx", path)
        return {
            "SkipSimplifiedLayerNormalization": records["no-past"]["norm_nodes"]["SkipSimplifiedLayerNormalization"]
        }

    monkeypatch.setattr(plain, "export_graph", copied)
    gpt2 = Path(records["no-past"]["source"])
    code, out, err = run_cli("export", gpt2, tmp_path / "fallback", "--format", "onnx")
    assert code == 0, err
    assert "exporting the forward without a cache instead (--no-past)" in err
    assert "key/value cache: none" in out
    record = json.loads((tmp_path / "fallback" / "normswap_manifest.json").read_text())["export"]
    assert record["with_past"] is False
