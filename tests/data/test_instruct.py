"""Prompt/completion and chat rows: the loss on completion and reply tokens only, against a
hand computation and against transformers' assistant-token masks; padding, truncation,
malformed rows, and training on a .jsonl file through the CLI."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from tformer.cli import main
from tformer.data.instruct import batch_of, encode_rows, read_rows
from tformer.data.tokenizers import IGNORE_INDEX, train_tokenizer
from tformer.errors import TformerError
from tformer.evaluation.loss import lm_loss
from tformer.models.gpt import GPT, GPTConfig

PAIRS = [("Q: two plus two?\nA:", " four"), ("Say hi:", " hi there"),
         ("", " an empty prompt"), ("Name a colour:", " red")]


def write_rows(path, pairs):
    path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n"
                            for p, c in pairs), encoding="utf-8")
    return path


@pytest.fixture
def tokenizer():
    return train_tokenizer("char", [t for pair in PAIRS for t in pair], specials=True)


def test_the_loss_counts_completion_tokens_only(tokenizer):
    rows = encode_rows(PAIRS, tokenizer, context=32, source="rows")
    batch = batch_of(rows)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, n_layer=1, n_head=2, d_model=16,
                          context=32)).eval()
    with torch.no_grad():
        got = lm_loss(model(batch.tokens), batch.targets)
        # By hand: each row alone, unpadded; -log p of every completion token and the end
        # token, given everything before it.
        total, count = 0.0, 0
        for prompt, completion in PAIRS:
            p = tokenizer.encode(prompt)
            ids = p + tokenizer.encode(completion) + [tokenizer.eos_id]
            logp = torch.log_softmax(model(torch.tensor([ids[:-1]]))[0].double(), -1)
            for j in range(max(len(p), 1), len(ids)):
                total -= float(logp[j - 1, ids[j]])
                count += 1
    assert int((batch.targets != IGNORE_INDEX).sum()) == count
    assert math.isclose(float(got), total / count, rel_tol=1e-6)


def test_long_rows_are_cut_or_dropped_with_one_warning(tokenizer, caplog):
    pairs = [("Say hi:", " hi there"), ("Q: two plus two?\nA:", " four"), ("Say", " hi")]
    with caplog.at_level(logging.WARNING):
        rows = encode_rows(pairs, tokenizer, context=10, source="rows.jsonl")
    assert [len(r.ids) for r in rows] == [11, 7]  # cut to context + 1; the second dropped
    assert rows[0].ids == (tokenizer.encode("Say hi:") + tokenizer.encode(" hi there"))[:11]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert "2 of 3 rows are longer than model.context + 1 = 11 tokens: 1 cut short, 1 dropped" \
        in messages[0]


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "a"}', "line 2: expected"),
    ("not json", "line 2: not a JSON object"),
    ('{"prompt": "a", "completion": 3}', "line 2: prompt and completion must be strings"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "line 2: no assistant message"),
    ('{"messages": []}', "line 2: expected"),
    ('{"messages": [{"role": "user"}]}', "line 2: message 1 must be"),
    ('{"messages": [{"role": "user", "content": 1}]}', "line 2: message 1 must be"),
    ('[1, 2]', "line 2: expected a JSON object"),
])
def test_a_malformed_row_is_an_error_naming_the_file_and_line(tmp_path, line, message):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(TformerError, match=message) as error:
        read_rows(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_a_gpt_trains_and_evaluates_on_prompt_completion_rows(tmp_path, capsys):
    rows = write_rows(tmp_path / "rows.jsonl", PAIRS * 10)
    config = tmp_path / "gpt.toml"
    config.write_text(f'[model]\nfamily = "gpt"\n[data]\npath = "{rows}"\n')
    tiny = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=32",
            "train.batch_size=4", "train.steps=4", "train.eval_every=2",
            "train.checkpoint_every=2", "train.warmup_steps=1", "train.device=cpu"]
    run, tuned = tmp_path / "run", tmp_path / "tuned"
    assert main(["train", str(config), "--out", str(run), *tiny]) == 0
    assert "prompt/completion" in capsys.readouterr().err
    assert main(["evaluate", str(run), str(rows), "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    # Every completion character and the end token; with an empty prompt, the first
    # character has nothing before it to be predicted from.
    assert measured["tokens"] == sum(len(c) + 1 - (p == "") for p, c in PAIRS * 10)
    # A LoRA on it, from the run: the usual instruction fine-tune.
    assert main(["train", str(config), "--out", str(tuned), *tiny, f"train.init_from={run}",
                 "train.lora.r=2"]) == 0
    assert main(["evaluate", str(tuned), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["tokens"] > 0


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"}]


def test_chat_rows_count_the_replies_only(tokenizer):
    """The plain template by hand: the replies and their end tokens are predicted, nothing
    of the turns around them."""
    chars = train_tokenizer("char", ["system: be brief\nuser: hi\nassistant: hello ciao bye"],
                            specials=True)
    eos = chars.eos_id
    pieces = [("system: be brief\nuser: hi\nassistant: ", False), ("hello", True),
              (None, True), ("\nuser: bye\nassistant: ", False), ("ciao", True), (None, True),
              ("\n", False)]
    ids, counted = [], []
    for text, reply in pieces:
        piece = [eos] if text is None else chars.encode(text)
        counted += [reply] * len(piece)
        ids += piece
    (row,) = encode_rows([CHAT], chars, context=128, source="rows")
    assert row.ids == ids
    batch = batch_of([row])
    assert (batch.targets[0] != IGNORE_INDEX).tolist() == counted[1:]
    # Cut by the context inside the second reply: the first reply and the start of the
    # second still count.
    (short,) = encode_rows([CHAT], chars, context=len(ids) - 5, source="rows")
    assert short.ids == ids[: len(ids) - 4]
    assert (batch_of([short]).targets[0] != IGNORE_INDEX).tolist() == counted[1: len(ids) - 4]


CHATML_GENERATION = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "Four."}],
    [{"role": "system", "content": "You answer in French."},
     {"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Bonjour !"},
     {"role": "user", "content": "And goodbye?"},
     {"role": "assistant", "content": "Au revoir, à bientôt."}],
    [{"role": "user", "content": "Count:\n\tone  two"}, {"role": "assistant", "content": "3"},
     {"role": "user", "content": "Thanks"}],
]


def test_reply_tokens_are_those_transformers_marks_as_the_assistants():
    """A byte-level BPE with ChatML's special tokens: tformer's row equals
    apply_chat_template's token ids, and its counted tokens the assistant-token mask the
    template's {% generation %} blocks give transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tformer.data.tokenizers import PretrainedBPETokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe.train_from_iterator(
        [m["content"] for conversation in CONVERSATIONS for m in conversation] * 3,
        trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    theirs = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>")
    theirs.chat_template = CHATML_GENERATION
    ours = PretrainedBPETokenizer(bpe, bos=None, eos="<|im_end|>")
    ours.chat_template = CHATML_GENERATION
    rows = encode_rows(CONVERSATIONS, ours, context=512, source="rows")
    for conversation, row in zip(CONVERSATIONS, rows, strict=True):
        want = theirs.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        assert row.ids == want["input_ids"]
        mask = [any(a <= j < b for a, b in row.counted) for j in range(len(row.ids))]
        assert mask == [bool(m) for m in want["assistant_masks"]]


def test_a_gpt_trains_on_chat_rows_and_keeps_the_template_it_rendered_them_with(
        tmp_path, capsys):
    from tformer.data.chat import DEFAULT_TEMPLATE

    rows = tmp_path / "chat.jsonl"
    rows.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(10))
                    + json.dumps({"prompt": "Say hi:", "completion": " hi"}) + "\n")
    config = tmp_path / "gpt.toml"
    config.write_text(f'[model]\nfamily = "gpt"\n[data]\npath = "{rows}"\n')
    tiny = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=96",
            "train.batch_size=4", "train.steps=2", "train.eval_every=2",
            "train.checkpoint_every=2", "train.warmup_steps=1", "train.device=cpu"]
    run = tmp_path / "run"
    assert main(["train", str(config), "--out", str(run), *tiny]) == 0
    assert "10 chat, rendered with the plain chat template" in capsys.readouterr().err
    assert (run / "best" / "chat_template.jinja").read_text() == DEFAULT_TEMPLATE
    assert main(["evaluate", str(run), str(rows), "--json"]) == 0
    # Each conversation's two replies and end tokens; the pair's completion and end token.
    assert json.loads(capsys.readouterr().out)["tokens"] == 10 * (5 + 1 + 4 + 1) + 3 + 1
