"""The serving section of README.md run as written: real servers on the README's runs, and
its curl lines and Python clients against them. In a module of its own (not
test_readme.py's), so that `--dist loadscope` runs it and test_readme.py's every line on
different workers."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .readme_lines import COMMANDS, ROOT, make_workdir, run_line


def serving_section() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("## Serving over HTTP")
    return text[start:text.index("\n## ", start + 1)]


def served_runs(section: str) -> set[str]:
    """The runs the section's `tformer serve` lines serve (runs/shakespeare, ...)."""
    lines = re.findall(r"^tformer serve (\S+)", section.replace("\\\n", " "), flags=re.M)
    assert lines, "the serving section serves no run"
    return set(lines)


def test_the_serving_examples_run_on_the_readme_runs(tmp_path, monkeypatch, capsys):
    """Each `tformer serve` line of the serving section starts a real server on the README's
    runs (on a free port instead of the README's), and the curl lines after it and the
    OpenAI client example run against it as written. The lm_eval line needs a downloaded
    task: tests/serving/test_lm_eval.py runs the same command on a local one."""
    from .serving.conftest import Server

    if shutil.which("curl") is None:
        pytest.skip("no curl on this machine")
    section = serving_section()
    # The runs it serves, made by the README's own lines for them, in README order (here
    # rather than after test_readme.py's every line, which another worker runs meanwhile).
    workdir = make_workdir(tmp_path)
    served = served_runs(section)
    for line in COMMANDS:
        words = shlex.split(line)
        if words[:2] == ["tformer", "train"] and words[words.index("--out") + 1] in served:
            code = run_line(line, workdir, monkeypatch, capsys)
            assert code == 0, f"{line!r} exited {code}: {capsys.readouterr().err[-2000:]}"
    assert all((workdir / run).is_dir() for run in served), served
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
