"""Ctrl-C at any moment of `tformer train`'s start, the imports of torch included: one line
on stderr and exit code 130, never a traceback."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CONFIG = """
[model]
family = "gpt"
n_layer = 1
n_head = 2
d_model = 16
context = 16

[data]
path = "{corpus}"

[train]
steps = 100000
batch_size = 4
eval_every = 100000
checkpoint_every = 100000
device = "cpu"
"""

CONSOLE_SCRIPT = Path(sys.executable).with_name("tformer")


@pytest.mark.parametrize("entry", ["module", "console script"])
def test_ctrl_c_in_the_first_two_seconds_is_one_line(tmp_path, tiny_corpus, entry):
    if entry == "console script" and not CONSOLE_SCRIPT.exists():
        pytest.skip("the tformer console script is not installed beside this Python")
    config = tmp_path / "tiny.toml"
    config.write_text(CONFIG.format(corpus=tiny_corpus))
    command = [str(CONSOLE_SCRIPT)] if entry == "console script" else [
        sys.executable, "-m", "tformer"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for n, moment in enumerate((0.3, 0.8, 1.3, 2.0)):
        proc = subprocess.Popen(
            [*command, "train", str(config), "--out", str(tmp_path / f"run{n}")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        time.sleep(moment)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, (moment, proc.returncode, err[-2000:])
        assert "Traceback" not in err, (moment, err[-2000:])
        assert "interrupted" in err or "stopped by SIGINT" in out, (moment, out, err)
