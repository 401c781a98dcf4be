"""`--resume` as a job scheduler uses it: the same command line run again after a kill,
whatever the run directory holds then: a newest checkpoint that disagrees with itself (its
manifest rewritten to match, so only reading it can tell), or no checkpoint at all yet."""

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from tformer import loading
from tformer.cli import main
from tformer.training.run import resume_point


def weights(checkpoint):
    return load_file(str(checkpoint / loading.WEIGHTS))


def assert_same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert wa[name].equal(wb[name]), name


def rewrite_manifest(path):
    manifest = {
        p.name: {"bytes": p.stat().st_size, "sha256": loading.sha256_of(p)}
        for p in sorted(path.iterdir()) if p.name != loading.MANIFEST
    }
    (path / loading.MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def uninterrupted(tmp_path, tiny_config):
    out = tmp_path / "uninterrupted"
    assert main(["train", str(tiny_config(steps=9)), "--out", str(out)]) == 0
    return out


def shape_disagrees(checkpoint):
    """config.json names a model of another shape than the weights hold."""
    config = json.loads((checkpoint / loading.CONFIG).read_text())
    config["model"]["d_model"] = 32
    (checkpoint / loading.CONFIG).write_text(json.dumps(config))


def header_damaged(checkpoint):
    """The safetensors header's length field says more bytes than the file has."""
    data = bytearray((checkpoint / loading.WEIGHTS).read_bytes())
    data[:8] = (1 << 40).to_bytes(8, "little")
    (checkpoint / loading.WEIGHTS).write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [shape_disagrees, header_damaged])
def test_resume_falls_back_past_a_checkpoint_that_disagrees_with_itself(
    tmp_path, tiny_config, uninterrupted, damage, caplog
):
    run = tmp_path / "run"
    assert main(["train", str(tiny_config(steps=9)), "--out", str(run),
                 "train.steps=6"]) == 0
    newest = loading.step_checkpoints(run)[-1]
    assert newest.name == "step-000006"
    damage(newest)
    rewrite_manifest(newest)  # the checksum passes: only reading it can tell
    assert resume_point(run).name == "step-000003"
    assert "skipping checkpoint step-000006" in caplog.text
    assert main(["train", "--resume", "--out", str(run), "train.steps=9"]) == 0
    assert_same_weights(loading.step_dir(run, 9), loading.step_dir(uninterrupted, 9))


DIE_AT_FIRST_CHECKPOINT = """
import os, sys
import tformer.training.trainer as trainer
trainer.save_step_checkpoint = lambda run: os._exit(9)  # killed as it would save
from tformer.cli import main
main(sys.argv[1:])
"""


def test_resume_before_the_first_checkpoint_starts_the_run_again(
    tmp_path, tiny_config, uninterrupted, caplog
):
    run = tmp_path / "run"
    config = tiny_config(steps=9)
    killed = subprocess.run(
        [sys.executable, "-c", DIE_AT_FIRST_CHECKPOINT, "train", str(config), "--out",
         str(run)], capture_output=True, timeout=120,
    )
    assert killed.returncode == 9, killed.stderr.decode()[-2000:]
    assert (run / loading.CONFIG).is_file() and not loading.step_checkpoints(run)
    assert main(["train", "--resume", "--out", str(run)]) == 0
    assert "no usable checkpoint yet: starting its run again from step 0" in caplog.text
    assert_same_weights(loading.step_dir(run, 9), loading.step_dir(uninterrupted, 9))


def test_resume_of_a_directory_that_is_not_a_run_is_an_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["train", "--resume", "--out", str(tmp_path / "empty")]) == 2
    assert "holds no usable checkpoint" in capsys.readouterr().err
