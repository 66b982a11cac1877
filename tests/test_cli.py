"""The CLI as a user meets it: quick start-up, one-line failures that come before any work,
suggestions for typos, readable listings. No model is loaded here; nothing touches the network
(offline is simulated with HF_HUB_OFFLINE or a refused connection)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "lm_eval", "datasets")


def _subprocess_env():
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_help_of_every_command_imports_no_heavy_module():
    """`normswap --help`, every subcommand's --help and `eval tasks-path` run without torch,
    transformers or lm-eval (what made them take 3-12 s); checked in a fresh interpreter."""
    script = f"""
import json, sys
from normswap.cli.main import COMMANDS, main
runs = [["--help"]] + [[c, "--help"] for c in COMMANDS] + \
[["eval", n, "--help"] for n in ("report", "ppl", "speed", "render")] \
    + [["eval", "tasks-path"], ["bench", "kernels", "--help"], ["bench", "convert", "--help"]] \
    + [["bench", "onnx", "--help"]]
codes = []
for argv in runs:
    try:
        main(argv)
        codes.append(0)
    except SystemExit as e:
        codes.append(e.code or 0)
heavy = [m for m in {HEAVY!r} if m in sys.modules]
import normswap.convert.plan  # negative control: the check sees torch once something imports it
print(json.dumps({{"codes": codes, "heavy": heavy, "control": "torch" in sys.modules}}))
"""
    p = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=_subprocess_env(), timeout=300
    )
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(got["codes"]) == {0}
    assert got["heavy"] == []
    assert got["control"] is True


def test_mistyped_command_gets_a_suggestion(run_cli):
    code, _, err = run_cli("covnert", "a", "b")
    assert code == 2 and "No such command 'covnert'" in err and "Did you mean 'convert'?" in err
    code, _, err = run_cli("xyzzy")  # nothing close: the commands are listed instead of a wrong guess
    assert code == 2 and "Did you mean" not in err and "convert" in err and "finetune" in err


def test_mistyped_baseline_names_the_models(run_cli):
    code, _, err = run_cli(
        "eval", "ppl", "orig=normswap:kjv-gpt2", "conv=normswap:kjv-neox", "--baseline", "orignal", "--quiet"
    )
    assert code != 0 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "--baseline orignal names none of the MODELs (orig, conv)" in err and "did you mean --baseline orig?" in err
    # negative control: a correct name, and a real model that is not in the list, are accepted
    from normswap.evaluate.side_by_side import plan_entries

    assert plan_entries(["orig=normswap:kjv-gpt2"], "orig") == ([("orig", "normswap:kjv-gpt2")], "orig")
    assert plan_entries(["orig=normswap:kjv-gpt2"], "normswap:kjv-neox")[1] == "baseline"


def _forbid(monkeypatch, target, what):
    def boom(*a, **k):
        raise AssertionError(f"{what} ran although the hub check should have stopped the command first")

    monkeypatch.setattr(target, boom)


def test_hub_data_offline_fails_before_finetune_starts(run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _forbid(monkeypatch, "normswap.finetune.run_finetune", "finetune")
    out = tmp_path / "out"
    code, _, err = run_cli("finetune", "normswap:kjv-gpt2", out, "--data", "wikitext:wikitext-2-raw-v1", "--steps", "3")
    assert code != 0 and len(err.strip().splitlines()) == 1
    assert "dataset wikitext:wikitext-2-raw-v1 must be downloaded from the Hub" in err and "HF_HUB_OFFLINE=1" in err
    assert not out.exists()


def test_hub_task_offline_fails_before_perplexity(run_cli, tmp_path, monkeypatch):
    """`--tasks hellaswag` needs lm-eval to download its dataset: refused before any model loads."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)

    def refused(*a, **k):  # the machine is offline: every connection fails at once
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(socket, "create_connection", refused)
    _forbid(monkeypatch, "normswap.evaluate.side_by_side.load_planned", "loading the models")
    code, _, err = run_cli(
        "eval", "report", "normswap:kjv-gpt2", "--out", tmp_path / "rep", "--tasks", "normswap_kjv,hellaswag"
    )
    assert code != 0 and len(err.strip().splitlines()) == 1
    assert "lm-eval task hellaswag must be downloaded" in err and "unreachable" in err and "normswap_kjv," not in err
    assert not (tmp_path / "rep").exists()


def test_local_sources_never_ask_for_the_hub(monkeypatch, tmp_path):
    """Negative control: shipped models, local paths, embedded data and normswap's tasks pass the
    check even offline, and an online hub passes too."""
    from normswap.evaluate.lm_eval_adapter import hub_tasks
    from normswap.network import data_needs_hub, model_needs_hub, require_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "corpus.txt").write_text("In the beginning\n")
    require_hub(
        models=["normswap:kjv-gpt2", str(tmp_path)],
        data="embedded",
        hub_tasks=hub_tasks("normswap_kjv,normswap_kjv_validation"),
    )
    require_hub(models=[], data=str(tmp_path / "corpus.txt"))
    assert data_needs_hub("wikitext:wikitext-2-raw-v1") and data_needs_hub("org/set")
    assert not data_needs_hub("embedded") and not data_needs_hub("./missing.txt")
    assert model_needs_hub("some-org/not-cached-model") and not model_needs_hub("normswap:kjv-gpt2")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)

    class Reachable:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: Reachable())
    require_hub(
        models=["some-org/not-cached-model"], data="wikitext:wikitext-2-raw-v1", hub_tasks=hub_tasks("hellaswag")
    )


def test_run_list_wraps_descriptions_at_word_boundaries(run_cli):
    import yaml

    from normswap.recipes import shipped_recipes

    code, out, _ = run_cli("run", "--list")
    assert code == 0
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 100
    for name, path in shipped_recipes().items():
        desc = " ".join(str(yaml.safe_load(path.read_text()).get("description", "")).split())
        if not desc:
            continue
        start = next(i for i, line in enumerate(lines) if line.startswith(name + " "))
        block = []
        for line in lines[start + 1 :]:
            if not line.startswith(" "):
                break
            block.append(line.strip())
        assert " ".join(block) == desc, name  # every word whole, nothing cut off


def test_plain_families_columns_are_aligned(run_cli):
    from normswap.architectures.catalog import family_rows

    code, out, _ = run_cli("families")
    assert code == 0
    rows = family_rows()
    lines = out.splitlines()
    assert len(lines) == len(rows)
    starts = {line.index(", ".join(r["model_types"]), len(r["display"])) for line, r in zip(lines, rows)}
    places = {line.rindex(r["placement"]) for line, r in zip(lines, rows)}
    assert len(starts) == 1 and len(places) == 1


def test_an_existing_out_is_refused_before_torch_loads(tmp_path):
    """convert, slice, export and finetune answer "OUT already exists; pass --force" before torch or
    transformers is imported (it took 6.5 s while they loaded first), and under --json the error is
    one JSON object on stdout. Ordering, not wall clock: the fresh interpreter records whether torch
    was imported when the command ended. Negative control: with --force the same command goes on
    past the check and imports torch."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "config.json").write_text("{}")
    out.mkdir()
    script = """
import json, sys
from normswap.cli.main import main
try:
    main(sys.argv[1:])
    code = 0
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "heavy": [m for m in ("torch", "transformers") if m in sys.modules]}), file=sys.stderr)
"""

    def run(*args):
        p = subprocess.run(
            [sys.executable, "-c", script, *map(str, args)],
            capture_output=True,
            text=True,
            env=_subprocess_env(),
            timeout=300,
        )
        *lines, last = p.stderr.strip().splitlines()
        return json.loads(last), p.stdout, lines

    commands = {
        "convert": ("convert", src, out),
        "slice": ("slice", src, out),
        "export": ("export", src, out, "--format", "stock"),
        "finetune": ("finetune", src, out),
    }
    for name, argv in commands.items():
        got, stdout, err = run(*argv, "--json")
        assert got == {"code": 2, "heavy": []}, (name, got, err)
        assert len(err) == 1 and "exists" in err[0] and "--force" in err[0], (name, err)
        answer = json.loads(stdout)
        assert answer["exit_code"] == 2 and "exists" in answer["error"] and not answer["error"].startswith("normswap")
    got, _, err = run("convert", src, out, "--force")  # control: past the check, the conversion's modules load
    assert got["code"] != 0 and "torch" in got["heavy"], (got, err)


def test_json_errors_are_json_on_stdout_and_old_json_file_spellings_say_what_replaced_them(run_cli, tmp_path):
    code, out, err = run_cli("convert", "only-src", "--json")  # a usage error, answered by click
    assert code == 2 and json.loads(out) == {"error": "Missing argument 'OUT'.", "exit_code": 2}
    code, out, err = run_cli("convert", "only-src")  # control: without --json, stdout stays empty
    assert code == 2 and out == "" and "Missing argument 'OUT'" in err
    # `--json FILE` was the benchmarks' file option: now a flag, so FILE is refused with the new spelling
    code, out, err = run_cli("bench", "decode", "--json", tmp_path / "r.json")
    assert code == 2 and "--save" in json.loads(out)["error"] and not (tmp_path / "r.json").exists()
    code, out, err = run_cli("bench", "slice", "--json", tmp_path / "r.json")
    assert code == 2 and "--save FILE writes it to a file" in json.loads(out)["error"]
