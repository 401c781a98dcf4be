"""Ctrl-C at any moment of `tformer train`'s start, the imports of torch included: one line
on stderr and exit code 130, never a traceback."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CONSOLE_SCRIPT = Path(sys.executable).with_name("tformer")


def as_a_shell_starts_it() -> None:
    """A terminal's foreground command starts with SIGINT neither ignored nor blocked. A
    child inherits both from the process that starts it (here a pytest worker, which other
    tests or libraries may have left otherwise), and a program rightly keeps an ignored
    SIGINT ignored, as one started with `&` must."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_in_the_first_two_seconds_is_one_line(tmp_path, tiny_config):
    """Through the console script that pip installs (`python -m tformer` at moments after
    torch starts loading: tests/training/test_run_safety.py)."""
    if not CONSOLE_SCRIPT.exists():
        pytest.skip("the tformer console script is not installed beside this Python")
    config = tiny_config(steps=100000, eval_every=100000, checkpoint_every=100000)
    command = [str(CONSOLE_SCRIPT)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for n, moment in enumerate((0.3, 0.8, 1.3, 2.0)):
        proc = subprocess.Popen(
            [*command, "train", str(config), "--out", str(tmp_path / f"run{n}")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            preexec_fn=as_a_shell_starts_it,
        )
        time.sleep(moment)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, (moment, proc.returncode, err[-2000:])
        assert "Traceback" not in err, (moment, err[-2000:])
        assert "interrupted" in err or "stopped by SIGINT" in out, (moment, out, err)
