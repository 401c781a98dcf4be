"""A run directory under faults that come from outside the process: a second writer, readers
while training saves, signals, a kill landing on a checkpoint's rename, a full disk, a
read-only disk and a file size limit. Those that need another process (a second writer, a
signal, a reader beside the writer, a kill) run `tformer` in a subprocess, as a user would; the
disk faults run the same command through the CLI's entry point in this process."""

import csv
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TINY_GPT, TINY_TEXT, toml_text
from tformer import loading
from tformer.cli import main
from tformer.training import checkpoint as ckpt
from tformer.training.run import resume_point


def write_config(tiny_config, *, steps=12, log_every=4, eval_every=3, checkpoint_every=3):
    """The tiny run with dropout (so resumed random streams matter) and these steps."""
    return tiny_config("config.toml", model={"dropout": 0.1}, steps=steps, log_every=log_every,
                       eval_every=eval_every, checkpoint_every=checkpoint_every,
                       keep_checkpoints=2, warmup_steps=2, lr=3e-3, min_lr=3e-4)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out.decode(), err.decode()


def wait_for(condition, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, finish(proc)
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def deterministic(run_dir: Path) -> list[tuple[str, ...]]:
    """metrics.csv without its clock columns (tokens_per_s, elapsed_s)."""
    return [(r["step"], r["split"], r["loss"], r["lr"], r["grad_norm"]) for r in rows(run_dir)]


def error_line(err: str) -> str:
    """The one thing a failed command says (progress bars aside), checked to be one line."""
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert "Traceback" not in err, err
    said = [line for line in lines if line.startswith("tformer:")]
    assert len(said) == 1 and lines[-1] == said[0], err
    return said[0]


def files_of(run_dir: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != ckpt.LOCK
    }


def no_temporaries(run_dir: Path) -> bool:
    names = [p.name for p in run_dir.rglob(".*")]
    return not [n for n in names if n.startswith((".tmp-", ".trash-", ".old-")) or ".tmp" in n]


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory) -> Path:
    """The tiny run trained for 6 steps, once: the fault tests below copy it and resume it."""
    tmp = tmp_path_factory.mktemp("six-steps")
    (tmp / "tiny.txt").write_text(TINY_TEXT, encoding="utf-8")
    config = tmp / "config.toml"
    config.write_text(toml_text({
        "model": {**TINY_GPT["model"], "dropout": 0.1},
        "data": {"path": str(tmp / "tiny.txt")},
        "train": {**TINY_GPT["train"], "steps": 6, "log_every": 4, "eval_every": 3,
                  "checkpoint_every": 3, "keep_checkpoints": 2, "warmup_steps": 2,
                  "lr": 3e-3, "min_lr": 3e-4},
    }), encoding="utf-8")
    assert main(["train", str(config), "--out", str(tmp / "run")]) == 0
    return tmp / "run"


def copy_run(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, symlinks=True)
    return to


def run_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """`tformer ARGS` through the CLI's own entry point, in this process: the exit code and
    what it printed, as a subprocess would give them, without the start-up of one."""
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# --- two writers, one run ----------------------------------------------------------------


def test_a_second_writer_is_refused_and_a_signal_stops_the_first(tmp_path, start_tformer,
                                                                  tiny_config):
    config = write_config(tiny_config, steps=100000, eval_every=50)
    run = tmp_path / "run"
    first = start_tformer("train", str(config), "--out", str(run))
    wait_for(lambda: (run / "metrics.csv").exists() and len(rows(run)) >= 2, first)
    wait_for(lambda: loading.latest_good_checkpoint(run) is not None, first)

    for args in (["train", str(config)], ["train", "--resume"]):
        code, out, err = finish(start_tformer(*args, "--out", str(run)))
        assert code == 2
        assert f"is in use by another tformer process (pid {first.pid})" in error_line(err)
    assert first.poll() is None, "the first run goes on"

    first.send_signal(signal.SIGTERM)
    code, out, err = finish(first)
    assert code == 143, err
    assert "stopped by SIGTERM" in out and "Traceback" not in err
    # Its last step is saved, the run is whole, and the lock is free again.
    last = loading.step_checkpoints(run)[-1]
    assert int(last.name.split("-")[1]) >= max(int(r["step"]) for r in rows(run))
    loading.verify_checkpoint(last)
    assert loading.load_checkpoint(run).cfg.train.steps == 100000
    assert no_temporaries(run)
    with ckpt.run_lock(run):
        pass


# --- signals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "signum,code",
    # SIGTERM's 143 is also checked, faster, by the second-writer test.
    [(signal.SIGINT, 130), pytest.param(signal.SIGTERM, 143, marks=pytest.mark.slow)],
)
def test_a_signal_saves_and_the_resumed_metrics_equal_an_uninterrupted_run(
    tmp_path, signum, code, start_tformer, tiny_config
):
    # log_every=4 with checkpoints every 3 steps: the resumed run must carry on the training
    # loss averaged since the last logged row.
    config = write_config(tiny_config, steps=24, log_every=4, checkpoint_every=3)
    straight, run = tmp_path / "straight", tmp_path / "stopped"
    uninterrupted = start_tformer("train", str(config), "--out", str(straight))
    proc = start_tformer("train", str(config), "--out", str(run))
    wait_for(lambda: (run / "metrics.csv").exists() and len(rows(run)) >= 2, proc)
    proc.send_signal(signum)
    got, out, err = finish(proc)
    assert got == code, err
    assert "Traceback" not in err and "--resume" in out
    stopped_at = int(loading.step_checkpoints(run)[-1].name.split("-")[1])
    assert stopped_at < 24, "the signal came before the end"

    assert finish(start_tformer("train", "--resume", "--out", str(run)))[0] == 0
    assert finish(uninterrupted)[0] == 0
    assert deterministic(run) == deterministic(straight)
    elapsed = [float(r["elapsed_s"]) for r in rows(run) if r["elapsed_s"]]
    assert elapsed == sorted(elapsed), "elapsed time goes on from the saved state"


def test_ctrl_c_during_start_up_prints_no_traceback(tmp_path, start_tformer, tiny_config):
    """Ctrl-C while tformer loads torch and its modules, or right after. (A signal that lands
    while the interpreter itself starts, before any of tformer's code has run, ends with
    Python's own traceback; so each interrupt waits until the process has mapped libtorch.)"""
    config = write_config(tiny_config)
    for delay in (0.0, 0.3, 1.0):
        proc = start_tformer("train", str(config), "--out", str(tmp_path / f"run{delay}"))
        wait_until_torch_is_loading(proc)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        code, out, err = finish(proc)
        assert "Traceback" not in err, err
        assert code in (130, 0), err  # 0: it finished first


def wait_until_torch_is_loading(proc: subprocess.Popen, timeout: float = 60) -> None:
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if "libtorch" in maps.read_text():
                return
        except OSError:  # gone between poll() and the read
            return
        time.sleep(0.002)


# --- readers while training writes -------------------------------------------------------


READER = """
import pathlib, sys, time
from tformer.loading import load_checkpoint
run, stop, ready = sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
loads, seen = 0, set()
ready.touch()
while not stop.exists():
    try:
        loaded = load_checkpoint(run)
    except Exception as e:
        if loads == 0 and ("no usable checkpoint" in str(e) or "not found" in str(e)):
            # Training has not saved yet (its process starts for seconds): a pause, not a
            # core spent asking, which that start and the other tests need. From the first
            # load on, the reader asks as fast as it can.
            time.sleep(0.01)
            continue
        print("FAILED", type(e).__name__, e)
        sys.exit(1)
    loads += 1
    seen.add(loaded.path.name)
print(loads, len(seen))
"""


def test_readers_see_whole_checkpoints_while_training_saves(tmp_path, tiny_config,
                                                            start_tformer):
    # A new best and a pruned step checkpoint at every step: as many switches as can be.
    config = write_config(tiny_config, steps=60, log_every=1, eval_every=1, checkpoint_every=1)
    run, stop, ready = tmp_path / "run", tmp_path / "stop", tmp_path / "ready"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    reader = subprocess.Popen([sys.executable, "-c", READER, str(run), str(stop), str(ready)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(ready.exists, reader)
    trainer = start_tformer("train", str(config), "--out", str(run), "train.lr=1e-2",
                            "train.keep_checkpoints=1", "train.eval_batches=1")
    code, out, err = finish(trainer)
    assert code == 0, err
    stop.touch()
    out, err = reader.communicate(timeout=60)
    assert reader.returncode == 0, out + err
    loads, versions = map(int, out.split())
    assert loads >= 3 and versions >= 3, "the reader saw best/ switch"
    assert "Traceback" not in err and "unusable" not in err and "damaged" not in err, err


# --- a kill landing on a checkpoint's rename ---------------------------------------------


KILL_ON_RENAME = """
import os, signal, sys
from tformer import loading
from tformer.training import checkpoint as ckpt
from tformer.cli import main
calls = {"n": 0}
real = os.replace
def replace(src, dst):
    calls["n"] += 1
    if calls["n"] == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(src, dst)
ckpt.os.replace = replace
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("nth", [3, 4, 5, 6, 7, 9])
def test_a_kill_on_a_checkpoint_rename_loses_nothing(tmp_path, nth, start_tformer, tiny_config):
    config = write_config(tiny_config, steps=9, log_every=1)
    straight, run = tmp_path / "straight", tmp_path / "run"
    uninterrupted = start_tformer("train", str(config), "--out", str(straight))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run(
        [sys.executable, "-c", KILL_ON_RENAME, str(nth), "train", str(config), "--out", str(run)],
        env=env, capture_output=True, timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL
    # A reader finds a whole checkpoint (or none yet), never an error.
    if loading.latest_good_checkpoint(run) is not None or (run / "best").exists():
        loading.load_checkpoint(run)
    if resume_point(run) is None:
        import shutil

        shutil.rmtree(run)
        code, out, err = finish(start_tformer("train", str(config), "--out", str(run)))
    else:
        code, out, err = finish(start_tformer("train", "--resume", "--out", str(run)))
    assert code == 0, err
    assert finish(uninterrupted)[0] == 0
    assert deterministic(run) == deterministic(straight)
    assert no_temporaries(run)
    assert not [p for p in run.glob(".best-*") if p != (run / "best").resolve()]


# --- full disk, read-only disk, file size limit --------------------------------------------


def test_a_file_size_limit_is_one_line_and_loses_nothing(tmp_path, capsys, six_steps):
    run = copy_run(six_steps, tmp_path / "run")
    before = files_of(run)
    last = loading.step_checkpoints(run)[-1]
    weights = (last / loading.WEIGHTS).stat().st_size
    state = (last / loading.TRAINER_STATE).stat().st_size
    assert weights < state
    limit = weights + 64  # the weights fit, the trainer state does not

    # Python ignores SIGXFSZ, so a write past the limit fails with EFBIG in this process too;
    # only the soft limit moves, and it is put back before anything else writes.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        code, out, err = run_in_process(capsys, "train", "--resume", "--out", str(run),
                                        "train.steps=9")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert code == 2
    said = error_line(err)
    assert "cannot save checkpoint" in said and "File too large" in said and str(run) in said
    assert no_temporaries(run)
    after = files_of(run)
    for name, data in before.items():  # every checkpoint saved before is as it was
        if name.startswith(("checkpoints/", ".best-")):
            assert after[name] == data, name
    loading.verify_checkpoint(last)
    assert run_in_process(capsys, "train", "--resume", "--out", str(run), "train.steps=9")[0] == 0


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs, where the machine lets us mount one (root in a container that
    allows it); skipped elsewhere."""
    mount = tmp_path / "fs"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                            capture_output=True)
    if result.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_one_line_and_loses_nothing(small_fs, capsys, six_steps):
    run = copy_run(six_steps, small_fs / "run")
    before = files_of(run)
    ballast = small_fs / "ballast"
    try:  # fill the disk to the last byte
        with open(ballast, "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError:
        pass
    code, out, err = run_in_process(capsys, "train", "--resume", "--out", str(run),
                                    "train.steps=9")
    assert code == 2
    said = error_line(err)
    assert "No space left on device" in said and str(run) in said
    assert no_temporaries(run)
    after = files_of(run)
    assert {k: v for k, v in after.items() if k != "metrics.csv"} == {
        k: v for k, v in before.items() if k != "metrics.csv"
    }
    ballast.unlink()
    assert run_in_process(capsys, "train", "--resume", "--out", str(run), "train.steps=9")[0] == 0


def test_a_read_only_disk_is_one_line(small_fs, capsys, six_steps):
    run = copy_run(six_steps, small_fs / "run")
    before = files_of(run)
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    code, out, err = run_in_process(capsys, "train", "--resume", "--out", str(run),
                                    "train.steps=9")
    assert code == 2
    said = error_line(err)
    assert "Read-only file system" in said and str(run) in said
    assert files_of(run) == before
    # Readers still read it.
    loading.load_checkpoint(run)
