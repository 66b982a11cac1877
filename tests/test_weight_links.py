"""Weight files follow the link rule of every other file in a model directory: a link that stays inside
the directory, or a hub snapshot's link into its own repository folder's ``blobs/``, is followed; a link
anywhere else is refused in one line and nothing is written.

The attack: a shared model directory whose ``model.safetensors`` links to another user's private
checkpoint (a 0700 directory the victim owns; the attacker needs only its path). The victim runs
``normswap convert shared-model out``: on normswap 9e09e2f that exited 0 and OUT held the victim's
private weights, converted, published as the shared model (the lines marked "fails before").
"""

import json
import os
from pathlib import Path

import pytest

from normswap.errors import NormswapError


def _kjv_files() -> Path:
    from normswap.assets.models import model_path

    return Path(model_path("kjv-gpt2"))


def _copy(dest: Path, skip=()) -> Path:
    dest.mkdir(parents=True)
    for p in _kjv_files().iterdir():
        if p.name not in skip:
            (dest / p.name).write_bytes(p.read_bytes())
    return dest


def test_a_weight_file_linked_to_another_users_private_checkpoint_is_refused(tmp_path, run_cli):
    private = tmp_path / "victim" / "private-model"
    _copy(private)
    os.chmod(private, 0o700)
    shared = _copy(tmp_path / "shared" / "model", skip=("model.safetensors",))
    (shared / "model.safetensors").symlink_to(private / "model.safetensors")
    out = tmp_path / "out"
    code, _, err = run_cli("convert", shared, out)
    assert code != 0, err  # fails before: exit 0, the private weights published in OUT
    lines = [line for line in err.strip().splitlines() if not line.startswith("normswap convert:")]
    assert len(lines) == 1 and "model.safetensors is a symbolic link to" in lines[0], err
    assert "outside the model directory" in lines[0] and "nothing was written" in lines[0]
    assert not out.exists() and not list(out.parent.glob(".out.normswap-staging-*"))
    code, _, err = run_cli("eval", "ppl", shared, "--max-tokens", "64", "--seq-len", "32", "--device", "cpu")
    assert code != 0 and "outside the model directory" in err  # eval reads no weights from elsewhere either
    # the control: the same link to a copy inside the model directory is followed
    (shared / "model.safetensors").unlink()
    (shared / "weights").mkdir()
    (shared / "weights" / "real.safetensors").write_bytes((private / "model.safetensors").read_bytes())
    (shared / "model.safetensors").symlink_to(Path("weights") / "real.safetensors")
    code, _, err = run_cli("convert", shared, out, "--no-verify")
    assert code == 0, err
    assert not (out / "model.safetensors").is_symlink()


def test_a_hub_snapshot_links_into_its_own_blobs_and_nowhere_else(tmp_path, run_cli):
    """The hub cache's layout (``models--org--name/snapshots/REV/x -> ../../blobs/HASH``) is the one place
    weights are linked from outside the snapshot folder, and only into the same repository folder."""
    repo = tmp_path / "hub" / "models--org--kjv"
    snap = repo / "snapshots" / "rev1"
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, p in enumerate(sorted(_kjv_files().iterdir())):
        (repo / "blobs" / f"blob{i}").write_bytes(p.read_bytes())
        (snap / p.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    code, _, err = run_cli("convert", snap, tmp_path / "out", "--no-verify")
    assert code == 0, err  # the control: a snapshot converts
    # another repository's blobs are not this snapshot's
    other = tmp_path / "hub" / "models--victim--private" / "blobs"
    other.mkdir(parents=True)
    (other / "weights").write_bytes((repo / "blobs" / "blob2").read_bytes())
    weights = snap / "model.safetensors"
    assert weights.resolve().parent == repo / "blobs"
    weights.unlink()
    weights.symlink_to(other / "weights")
    code, _, err = run_cli("convert", snap, tmp_path / "out2", "--no-verify")
    assert code != 0 and "outside the model directory" in err, err
    assert not (tmp_path / "out2").exists()


def test_a_shard_an_index_names_through_a_linked_folder_is_refused(tmp_path):
    """The weight-file finder itself applies the rule to every file an index names, also below a folder
    (here a folder that is a link out of the model directory), not only to the top-level names."""
    from normswap.checkpoint.tensor_source import weight_files

    elsewhere = _copy(tmp_path / "elsewhere")
    model = _copy(tmp_path / "model", skip=("model.safetensors",))
    (model / "shards").symlink_to(elsewhere)
    from safetensors import safe_open

    with safe_open(str(elsewhere / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    index = {"metadata": {}, "weight_map": {k: "shards/model.safetensors" for k in keys}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(NormswapError, match="outside the model directory"):
        weight_files(model)
    # the control: the same index naming a real folder inside the model directory
    (model / "shards").unlink()
    _copy(model / "shards", skip=[p.name for p in _kjv_files().iterdir() if p.name != "model.safetensors"])
    fmt, files = weight_files(model)
    assert fmt == "safetensors" and files == [model / "shards" / "model.safetensors"]
