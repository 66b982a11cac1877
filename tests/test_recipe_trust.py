"""Recipes cannot grant trust: a model's own code runs only when the person running the command passes
``--trust-remote-code``. A recipe is a file someone hands you, like a model directory; one that says
``trust_remote_code: true`` is refused in one line that says how to grant it.

On normswap 9e09e2f, ``normswap run recipe.yaml`` without the flag imported and ran the source's
``configuration_*.py`` because the recipe said so (the line marked "fails before").
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CODE = """\
import os
from pathlib import Path

Path(os.environ["NORMSWAP_TEST_MARKER"]).write_text("the model's own code ran")
raise SystemExit(3)  # proof enough; the rest of the run is not what the test is about
"""


def _model_with_code(dest: Path) -> Path:
    from normswap.assets.models import model_path

    dest.mkdir()
    for p in Path(model_path("kjv-gpt2")).iterdir():
        (dest / p.name).write_bytes(p.read_bytes())
    config = json.loads((dest / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_marker.MarkerConfig"}
    (dest / "config.json").write_text(json.dumps(config))
    (dest / "configuration_marker.py").write_text(CODE)
    return dest


def _run(recipe: Path, out: Path, marker: Path, *flags) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NORMSWAP_TEST_MARKER": str(marker), "HF_HUB_OFFLINE": "1"}
    env["HF_MODULES_CACHE"] = str(marker.parent / "hf-modules")  # transformers copies the code here to import it
    r = subprocess.run(
        [sys.executable, "-m", "normswap", "run", str(recipe), "--out", str(out), *flags],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return r.returncode, r.stderr


def test_a_recipe_that_turns_on_remote_code_is_refused_without_the_flag(tmp_path):
    model = _model_with_code(tmp_path / "model")
    marker = tmp_path / "ran.txt"
    recipe = tmp_path / "recipe.yaml"
    body = f"name: t\nsource: {model}\ndevice: cpu\nvariants:\n  exact: {{convert: {{mode: exact}}}}\n"
    recipe.write_text(body + "trust_remote_code: true\n")
    code, err = _run(recipe, tmp_path / "out", marker)
    assert not marker.exists(), err  # fails before: the recipe alone made the model's code run
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code != 0 and len(lines) == 1 and "Traceback" not in err, err
    assert "trust_remote_code: true" in lines[0] and "pass --trust-remote-code on the command line" in lines[0]
    assert not (tmp_path / "out" / "models").exists()
    # the control: the person running the command grants it, and then the code does run
    code, err = _run(recipe, tmp_path / "out2", marker, "--trust-remote-code")
    assert code == 3 and marker.exists(), err
