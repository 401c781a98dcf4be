"""`tformer chat` from a pipe: one message a line, each reply on a line, the history in
every prompt, /reset and /exit, Ctrl-C stopping one reply and not the session."""

from __future__ import annotations

import io

import pytest

from tformer.cli import main

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import torch

    from tformer.config import RunConfig, TrainConfig
    from tformer.data.lm import LMDataConfig
    from tformer.data.tokenizers import CharTokenizer
    from tformer.models.gpt import GPT, GPTConfig
    from tformer.training.checkpoint import save_checkpoint

    # characters: a random model's every token shows as text, so a reply streams in pieces
    tokenizer = CharTokenizer("abcdefghijklmnopqrstuvwxyz \n", specials=True)
    tokenizer.chat_template = TEMPLATE
    cfg = GPTConfig(vocab_size=tokenizer.vocab_size, n_layer=1, n_head=2, d_model=32,
                    context=256, dropout=0.0)
    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.no_grad():  # large random weights: each context its own greedy text
        for p in model.parameters():
            p.normal_(0.0, 1.0)
        model.embed.weight[tokenizer.encode(" \n")] -= 4.0  # letters, mostly
    path = tmp_path_factory.mktemp("chat") / "run"
    save_checkpoint(path, RunConfig("gpt", cfg, LMDataConfig(), TrainConfig()), model,
                    tokenizer)
    return path


def chat(checkpoint, lines, monkeypatch, capsys, *options):
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    capsys.readouterr()
    assert main(["chat", str(checkpoint), "--temperature", "0", "--max-new-tokens", "8",
                 "--device", "cpu", *options]) == 0
    return capsys.readouterr()


def expected_reply(checkpoint, messages) -> str:
    """The greedy continuation of the conversation rendered by its template."""
    import tformer
    from tformer.data.chat import encode_text, template_of

    model = tformer.load(checkpoint, device="cpu")
    prompt = template_of(model.tokenizer).render(messages, add_generation_prompt=True)
    ids = encode_text(model.tokenizer, prompt)
    return "".join(model.stream(ids, max_new_tokens=8, temperature=0)).strip()


def test_each_reply_follows_the_whole_conversation(checkpoint, monkeypatch, capsys):
    out = chat(checkpoint, ["hear me", "say more", "/reset", "hear me", "/exit", "unread"],
               monkeypatch, capsys, "--system", "speak").out
    first = expected_reply(checkpoint, [{"role": "system", "content": "speak"},
                                        {"role": "user", "content": "hear me"}])
    second = expected_reply(checkpoint, [
        {"role": "system", "content": "speak"}, {"role": "user", "content": "hear me"},
        {"role": "assistant", "content": first}, {"role": "user", "content": "say more"}])
    assert first != second
    # after /reset the conversation is the system message and the first question again
    assert out == f"{first}\n{second}\n{first}\n"


def test_ctrl_c_stops_a_reply_and_the_session_goes_on(checkpoint, monkeypatch, capsys):
    from tformer.api import Model

    stream, calls = Model.stream, []

    def interrupted_once(self, *args, **kwargs):
        calls.append(1)
        for i, piece in enumerate(stream(self, *args, **kwargs)):
            if len(calls) == 1 and i == 1:
                raise KeyboardInterrupt
            yield piece

    monkeypatch.setattr(Model, "stream", interrupted_once)
    got = chat(checkpoint, ["hear me", "say more"], monkeypatch, capsys)
    assert "(stopped)" in got.err
    assert len(calls) == 2 and got.out.count("\n") >= 2
