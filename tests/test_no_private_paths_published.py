"""No path of a private directory in any published file (security.md S7.8), and a malformed field of the
normswap config block gets the one "damaged" line (#57 case 8).

A sliced checkpoint's config.json used to keep ``_name_or_path`` pointing at slice's private working
directory (/tmp/normswap-slice-*/converted), and every published file of a converted or sliced model
named the source's local directory. Now each keeps only the source's name.
"""

from __future__ import annotations

import json

from helpers import tiny_model

from normswap import public_paths

PUBLISHED = ("config.json", "normswap_manifest.json", "README.md", "slice.json")


def _leaks(directory, private: str) -> list[str]:
    found = []
    for name in PUBLISHED:
        path = directory / name
        if path.exists():
            text = path.read_text()
            for needle in (private, "normswap-slice-", "_name_or_path"):
                if needle in text:
                    found.append(f"{name}: {needle}")
    return found


def test_sliced_and_converted_checkpoints_name_no_private_directory(tmp_path, run_cli):
    src = tmp_path / "home-of-alice" / "my-source"
    tiny_model("gpt2", 0).save_pretrained(src)
    code, _, err = run_cli("slice", src, tmp_path / "sliced", "--calibration-tokens", "1024")
    assert code == 0, err
    code, _, err = run_cli("convert", src, tmp_path / "converted")
    assert code == 0, err
    for out in ("sliced", "converted"):
        assert _leaks(tmp_path / out, str(tmp_path)) == [], out
    assert (tmp_path / "sliced" / "slice.json").exists()
    # the provenance stays: the source's own name
    manifest = json.loads((tmp_path / "converted" / "normswap_manifest.json").read_text())
    assert manifest["conversion"]["source"] == "my-source"


def test_control_without_the_scrub_the_paths_are_published(tmp_path, run_cli, monkeypatch):
    """The control: with the publication step's scrub off, the same command publishes the local paths."""
    monkeypatch.setattr(public_paths, "scrub_checkpoint_dir", lambda directory: None)
    src = tmp_path / "home-of-alice" / "my-source"
    tiny_model("gpt2", 0).save_pretrained(src)
    code, _, err = run_cli("convert", src, tmp_path / "converted", "--no-verify")
    assert code == 0, err
    assert _leaks(tmp_path / "converted", str(tmp_path))


def test_public_text_keeps_fractions_and_hub_ids():
    assert public_paths.public_text("from /home/alice/models/gpt2-x, β/γ, float32/float64") == (
        "from gpt2-x, β/γ, float32/float64"
    )
    assert public_paths.public_text("openai-community/gpt2") == "openai-community/gpt2"


def test_malformed_slice_width_is_a_damaged_config(tmp_path, run_cli):
    src = tmp_path / "src"
    tiny_model("gpt2", 0).save_pretrained(src)
    code, _, err = run_cli("slice", src, tmp_path / "sliced", "--calibration-tokens", "1024")
    assert code == 0, err
    config = json.loads((tmp_path / "sliced" / "config.json").read_text())
    config["normswap"]["slice"]["width"] = [config["normswap"]["slice"]["width"]]
    (tmp_path / "sliced" / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli("convert", tmp_path / "sliced", tmp_path / "again")
    assert code != 0 and "TypeError" not in err
    assert "normswap.slice declares width [" in err and "(the file is damaged)" in err
    assert not (tmp_path / "again").exists()
