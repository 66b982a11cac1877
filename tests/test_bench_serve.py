"""`normswap bench serve`: its options' bad input is one line, and its goals read the numbers they name
(a met and an unmet row each, so a goal that always passes fails here). The runs themselves are
benchmarks (results/serve-*), never timed tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from normswap.benchmarks.serve import quality_goals, speed_goals


def test_unknown_kind_is_one_line(run_cli, tmp_path):
    save = tmp_path / "out.json"
    code, out, err = run_cli("bench", "serve", "--kinds", "decode,warp", "--save", save)
    assert code != 0 and "--kinds: warp" in err and len(err.strip().splitlines()) == 1
    assert not save.exists()


def _ratio(low, high=None):
    return {"ratio": low, "low": low, "high": high or low}


def test_speed_goals_read_the_lower_ends():
    run = {"over_original": {"sliced": _ratio(1.3), "sliced int8": _ratio(2.2)}, "null_control": _ratio(0.99, 1.01)}
    goals = speed_goals({"decode": run})
    assert goals["decode sliced low >= 1.25"]["met"]
    assert not goals["decode sliced int8 low >= 2.3"]["met"]
    assert goals["decode null control inside ±2%"]["met"]
    run["null_control"] = _ratio(0.97, 1.01)
    assert not speed_goals({"decode": run})["decode null control inside ±2%"]["met"]


def _arm(loss, agree=0.95):
    return {"perplexity": 10 * (1 + loss), "loss_vs_float32": loss, "greedy_agreement_with_float32": agree}


def test_quality_goals_compare_rotated_with_unrotated():
    row = {
        "model": "m",
        "variants": {
            "sliced": {"float32": {"perplexity": 10}, "int8": _arm(0.05), "int8 rotated": _arm(0.005)},
            "planted outlier": {"float32": {"perplexity": 10}, "int8": _arm(0.004), "int8 rotated": _arm(0.003, 0.8)},
        },
    }
    goals = quality_goals([row])
    assert goals["m sliced: int8 rotated loses <= 1%"]["met"]
    assert goals["m sliced: rotated no worse than without"]["met"]
    assert not goals["m planted outlier: unrotated loses clearly more"]["met"]
    assert not goals["m planted outlier int8 rotated: greedy agreement >= 90%"]["met"]
    row["variants"]["planted outlier"]["int8"] = _arm(0.2)
    assert quality_goals([row])["m planted outlier: unrotated loses clearly more"]["met"]


# -- the timed calls on real generation graphs (a tiny GPT-2 built from its config; nothing is timed) --------


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """(model, {"past": generation graph dir, "no-past": forward-only graph dir}) of one tiny GPT-2, both
    written by bench serve's own write_graph (the code that builds its speed graphs)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from helpers import tiny_model

    from normswap.benchmarks.serve import write_graph

    root = tmp_path_factory.mktemp("serve-graphs")
    model = tiny_model("gpt2", n_positions=64)
    for name, past in (("past", True), ("no-past", False)):
        write_graph(model, root / name / "original", quantize=False, rotate=False, with_past=past)
    return model, {"past": root / "past", "no-past": root / "no-past"}


@pytest.mark.slow  # the fixture's two tiny GPT-2 exports: ~50 s on a loaded 2-core host
def test_decode_is_one_step_on_the_cache(graphs):
    """The timed decode call is one token on a cache of --past-tokens tokens: its logits are PyTorch's at
    that position of prompt + token, every call alike (the past length stays fixed); prefill's call is the
    prompt's forward. Control: the same token without the cache (the old one-token forward) is not that."""
    import onnxruntime as ort

    from normswap.benchmarks.serve import _decode_call, _prefill_call, _prompt
    from normswap.export.onnx_generate import prefill_feed

    model, dirs = graphs
    path = dirs["past"] / "original" / "model.onnx"
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    vocab, past = int(model.config.vocab_size), 16
    ids = torch.from_numpy(np.concatenate([_prompt(past, vocab), _prompt(1, vocab)], 1))
    with torch.no_grad():
        want = model(input_ids=ids).logits.numpy()
    step = _decode_call(sess, path, past, vocab)
    for _ in range(2):
        out = dict(zip([o.name for o in sess.get_outputs()], step()))
        assert out["present.0.key"].shape[2] == past + 1 and out["logits"].shape[1] == 1
        assert np.abs(out["logits"][0, -1] - want[0, past]).max() < 1e-4
    prefill = _prefill_call(sess, past, vocab)()[0]
    assert prefill.shape[1] == past and np.abs(prefill[0] - want[0, :past]).max() < 1e-4
    alone = sess.run(None, prefill_feed(sess, ids[:, past:].numpy()))[0]
    assert np.abs(alone[0, -1] - want[0, past]).max() > 1e-3


@pytest.mark.slow  # the fixture's two tiny GPT-2 exports: ~50 s on a loaded 2-core host
def test_graphs_folder_without_the_cache_is_refused(graphs, run_cli, tmp_path):
    """--graphs holding a forward-only (--no-past) graph: one line, nothing saved, before any build.
    Control: the generation graph's folder passes the same check."""
    from normswap.benchmarks.serve import require_generation_graphs

    _, dirs = graphs
    save = tmp_path / "out.json"
    code, out, err = run_cli("bench", "serve", "--part", "speed", "--graphs", dirs["no-past"], "--save", save)
    assert code != 0 and len(err.strip().splitlines()) == 1
    assert "original graph" in err and "not a generation graph" in err and "no past key/values" in err
    assert not save.exists()
    require_generation_graphs({"original": dirs["past"] / "original"})


def test_unknown_graph_in_only_is_one_line(run_cli):
    code, _, err = run_cli("bench", "serve", "--part", "speed", "--only", "sliced,warp")
    assert code != 0 and "--only: warp" in err and len(err.strip().splitlines()) == 1
