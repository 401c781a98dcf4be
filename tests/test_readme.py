"""Every `tformer` command line in README.md's code blocks runs as written, on small runs.

The lines are read from the README itself, so the README cannot drift from the code: a
renamed option, or an order of arguments the parser does not take, fails here. Each line
runs with the same words; only the sizes are shrunk (readme_lines.py says how).
torchrun lines are checked for their tformer part only; the serving section's servers and
clients run in test_readme_serving.py.
"""

from __future__ import annotations

import re
import shlex

import pytest

from tformer.cli import main

from .readme_lines import COMMANDS, LM_DATA, ROOT, SMALL, make_workdir, run_line, smollm2_file


def test_the_readme_has_commands_for_every_subcommand():
    used = {shlex.split(c)[shlex.split(c).index("tformer") + 1] for c in COMMANDS}
    assert used >= {"train", "generate", "evaluate", "translate", "average"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return make_workdir(tmp_path_factory.mktemp("readme"))


def test_every_readme_command_runs(workdir, monkeypatch, capsys):
    """In README order: trainings come before the commands that read their runs."""
    gguf = smollm2_file()
    # The Transformer-XL run the README evaluates with other memory lengths.
    assert main(["train", str(ROOT / "configs" / "txl-shakespeare-char.toml"), "--out",
                 str(workdir / "runs" / "txl"), *SMALL,
                 *[w.format(tmp=workdir) for w in LM_DATA], "model.mem_len=8"]) == 0
    for line in COMMANDS:
        if line.startswith("torchrun"):
            continue  # several processes: tests/training/test_distributed.py
        if "smollm2" in line and gguf is None:
            continue  # the real model is not installed here
        if "tformer serve" in line:
            # A server runs until it is stopped: tests/serving starts it for real. Here its
            # command line must parse.
            from tformer.cli import build_parser

            words = [w for w in shlex.split(line) if w != "&"]
            assert build_parser().parse_args(words[words.index("tformer") + 1 :]).command == (
                "serve")
            continue
        code = run_line(line, workdir, monkeypatch, capsys)
        assert code == 0, f"{line!r} exited {code}: {capsys.readouterr().err[-2000:]}"
    assert (workdir / "sentences.de").read_text().count("\n") == 3
    assert (workdir / "output.de").read_text().count("\n") == 3
    assert (workdir / "runs" / "multi30k" / "averaged" / "model.safetensors").exists()


def test_the_python_example_runs_on_the_readme_runs(workdir, monkeypatch, capsys):
    """After the command lines above made runs/shakespeare and runs/multi30k."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Using it from Python"):]
    (example,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)[:1]
    assert (workdir / "runs" / "shakespeare").is_dir(), "runs after the README's commands"
    monkeypatch.chdir(workdir)
    exec(compile(example, "README.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert len(out) >= 3 and out[-1].startswith("['")


def test_torchrun_lines_run_tformer_train():
    lines = [c for c in COMMANDS if c.startswith("torchrun")]
    assert lines
    for line in lines:
        words = shlex.split(line)
        i = words.index("tformer")
        assert words[i - 1] == "-m" and words[i + 1] == "train"
        # Its arguments parse as a train command line.
        from tformer.cli import build_parser

        args, extra = build_parser().parse_known_args(words[i + 1 :])
        assert not extra and args.config.endswith(".toml") and args.out


@pytest.mark.parametrize("target", ["demo:", "$(STAMP):"])
def test_make_says_what_it_does_before_any_slow_step(target):
    """`make demo` speaks within a second: the first command of the demo and of the set-up
    it may run first is an echo, before Python or pip start."""
    lines = (ROOT / "Makefile").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(target))
    assert lines[start + 1].strip().startswith("@echo ")
