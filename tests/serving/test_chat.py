"""Chat: templates rendered as transformers renders them, and /v1/chat/completions through
the openai client against a real server, against completions of the rendered prompt."""

from __future__ import annotations

import jinja2
import openai
import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from tformer.data.chat import ChatTemplate, ChatTemplateError, load_chat_template
from tformer.errors import TformerError
from tformer.serving.chat import end_of_turn
from tformer.serving.tokens import TokenTexts

from .conftest import CHAT_TEMPLATE

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt "
          "%}{{ '<|im_start|>assistant\\n' }}{% endif %}")

LLAMA2 = """
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}
    {% set rest = messages[1:] %}
{% else %}
    {% set system = '' %}
    {% set rest = messages %}
{% endif %}
{% for message in rest %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ bos_token + '[INST] ' + (system + '\\n\\n' if loop.first and system else '')
           + message['content'] | trim + ' [/INST]' }}
    {% else %}
        {{ ' ' + message['content'] | trim + ' ' + eos_token }}
    {% endif %}
{% endfor %}
"""

LOOPS = """
{%- set ns = namespace(n=0) -%}
{% for m in messages %}
  {% if m.role == 'stop' %}{% break %}{% endif %}
  {% if m.role == 'skip' %}{% continue %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  <{{ m.role }}>{% generation %}{{ m.content | tojson }}{% endgeneration %}
{% endfor %}
count={{ ns.n }}{% if add_generation_prompt %}<assistant>{% endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " héllo <b>&</b> "},
     {"role": "assistant", "content": "Hi! "}, {"role": "user", "content": "And now?"}],
    [{"role": "user", "content": "a"}, {"role": "skip", "content": "x"},
     {"role": "assistant", "content": "\u00e9\u4e2d\"q\""}, {"role": "stop", "content": "y"},
     {"role": "user", "content": "never"}],
]


def hf_tokenizer(template: str) -> PreTrainedTokenizerFast:
    words = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok = PreTrainedTokenizerFast(tokenizer_object=words, bos_token="<s>", eos_token="</s>")
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("template", [CHATML, LLAMA2, LOOPS], ids=["chatml", "llama2", "loops"])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one", "system", "loops"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_rendering_equals_transformers(template, messages, generation_prompt):
    ours = ChatTemplate(template, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    try:
        want = hf_tokenizer(template).apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt)
    except jinja2.exceptions.TemplateError as e:
        with pytest.raises(ChatTemplateError, match=str(e)):
            ours.render(messages, add_generation_prompt=generation_prompt)
        return
    assert ours.render(messages, add_generation_prompt=generation_prompt) == want


def test_the_end_of_turn_is_found():
    assert ChatTemplate(CHATML).end_of_turn == "<|im_end|>"
    assert ChatTemplate(LLAMA2, special_tokens={"bos_token": "<s>",
                                                 "eos_token": "</s>"}).end_of_turn == "</s>"
    assert ChatTemplate("{% for m in messages %}{{ m.content }}\n{% endfor %}").end_of_turn is None


def test_an_end_of_turn_that_is_one_token_stops_as_a_token(loaded):
    texts = TokenTexts(loaded.tokenizer)
    eos_turn = ChatTemplate("{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
                            special_tokens={"eos_token": "</s>"})
    assert end_of_turn(eos_turn, texts) == ([], (loaded.tokenizer.eos_id,))
    assert end_of_turn(ChatTemplate(CHATML), texts) == (["<|im_end|>"], ())


def test_a_bad_template_or_file_is_one_clear_error(tmp_path):
    with pytest.raises(TformerError, match="not a valid Jinja template: line 1"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(TformerError, match="no such file"):
        load_chat_template(tmp_path, tmp_path / "missing.jinja", {})
    assert load_chat_template(tmp_path, None, {}) is None
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    assert load_chat_template(tmp_path, None, {}).source == CHATML


# --- the server ---------------------------------------------------------------------------

TEMPLATE = CHAT_TEMPLATE

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def client(run_server):
    return openai.OpenAI(base_url=run_server.url + "/v1", api_key="none", max_retries=0)


def rendered() -> str:
    return ChatTemplate(TEMPLATE).render(MESSAGES, add_generation_prompt=True)


def test_a_chat_reply_is_the_completion_of_the_rendered_prompt(client):
    reply = client.chat.completions.create(model="tiny-run", messages=MESSAGES, max_tokens=30,
                                           temperature=0, logprobs=True, top_logprobs=2)
    plain = client.completions.create(model="tiny-run", prompt=rendered(), max_tokens=30,
                                      temperature=0, logprobs=2, stop=["end!"])
    assert reply.object == "chat.completion" and reply.model == "tiny-run"
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == plain.choices[0].text
    assert choice.finish_reason == plain.choices[0].finish_reason
    assert reply.usage.prompt_tokens == len(rendered())
    content = choice.logprobs.content
    # The second request finds the prompt's first blocks in the prefix cache and reads the
    # rest as a shorter chunk, which may attend through another kernel: the same to rounding.
    assert [c.logprob for c in content] == pytest.approx(
        plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert [c.token for c in content] == plain.choices[0].logprobs.tokens
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content)


def test_a_chat_stream_with_usage(client):
    whole = client.chat.completions.create(model="tiny-run", messages=MESSAGES, n=2, seed=7,
                                           max_completion_tokens=20, temperature=1.0)
    stream = client.chat.completions.create(model="tiny-run", messages=MESSAGES, n=2, seed=7,
                                            max_completion_tokens=20, temperature=1.0,
                                            stream=True, stream_options={"include_usage": True})
    texts, reasons, roles, usage = ["", ""], [None, None], set(), None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles |= {c.delta.role} - {None}
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.message.content for c in whole.choices]
    assert reasons == [c.finish_reason for c in whole.choices]
    assert roles == {"assistant"} and usage.total_tokens == whole.usage.total_tokens
    assert whole.choices[0].message.content != whole.choices[1].message.content


def test_a_reply_stops_at_the_end_of_turn(client):
    """Greedy decoding that writes the end-of-turn text ends there, with reason 'stop'."""
    prompt = rendered() + " hi end!\nuser. again end!\nassistant."
    plain = client.completions.create(model="tiny-run", prompt=prompt, max_tokens=40,
                                      temperature=0)
    text = plain.choices[0].text
    reply = client.chat.completions.create(model="tiny-run", temperature=0, max_tokens=40,
                                           messages=[*MESSAGES,
                                                     {"role": "assistant", "content": "hi"},
                                                     {"role": "user", "content": "again"}])
    if "end!" in text:
        assert reply.choices[0].message.content == text[: text.index("end!")]
        assert reply.choices[0].finish_reason == "stop"
    else:
        assert reply.choices[0].message.content == text


def test_chat_requests_refused(client):
    for extra in [{"top_logprobs": 2}, {"max_tokens": 3, "max_completion_tokens": 4},
                  {"temperature": 3}]:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny-run", messages=MESSAGES, **extra)
    # The tiny model's characters hold no "{": no JSON can be written with them.
    with pytest.raises(openai.BadRequestError, match="no token of this model's vocabulary"):
        client.chat.completions.create(model="tiny-run", messages=MESSAGES,
                                       response_format={"type": "json_object"})
    accepted = client.chat.completions.create(
        model="tiny-run", messages=MESSAGES, max_tokens=2, user="u", store=False,
        metadata={"a": "b"}, parallel_tool_calls=False, tool_choice="none",
        response_format={"type": "text"}, frequency_penalty=0.5)
    assert accepted.usage.completion_tokens <= 2


def test_a_model_without_a_template_says_how_to_give_one(app_client):
    r = app_client.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "no_chat_template"
    assert "chat_template.jinja" in error["message"] and "--chat-template FILE" in (
        error["message"])


def test_an_end_of_turn_token_ends_the_reply(loaded):
    """A template whose turns end with '!', one token here: a reply biased to write it
    ends at once with reason 'stop', where a completion goes on writing it."""
    from fastapi.testclient import TestClient

    from tformer.serving.app import create_app
    from tformer.serving.scheduler import LMEngine

    tok = loaded.tokenizer
    engine = LMEngine(loaded.model, eos_id=tok.eos_id, max_batch=4, max_waiting=8,
                      batched=True)
    template = ChatTemplate("{% for m in messages %}{{ m.content }}!\n{% endfor %}")
    app = create_app(engine, tok, model_name="m", kind="lm", chat_template=template)
    bias = {str(tok.encode("!")[0]): 100}
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 5, "logit_bias": bias})
        plain = client.post("/v1/completions", json={
            "prompt": "hello!\n", "max_tokens": 5, "logit_bias": bias})
        info = client.get("/tokenizer_info").json()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == ""
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert plain.json()["choices"][0]["text"] == "!!!!!"
    assert info["chat_template"] == template.source


def test_rendered_text_encodes_special_token_names_as_their_ids():
    """A character tokenizer knows `</s>` only as an id: rendered prompts (the plain
    template ends each reply with it) must reach the model as that id, as a pretrained
    tokenizer's own parsing gives."""
    from tformer.data.chat import encode_text
    from tformer.data.tokenizers import PretrainedBPETokenizer, train_tokenizer

    chars = train_tokenizer("char", ["ab: "], specials=True)
    assert encode_text(chars, "a</s>b: <s>") == [*chars.encode("a"), chars.eos_id,
                                                 *chars.encode("b: "), chars.bos_id]
    assert encode_text(chars, "ab") == chars.encode("ab")
    words = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "a": 2, "[UNK]": 3},
                                       unk_token="[UNK]"))
    words.add_special_tokens(["<s>", "</s>"])
    pretrained = PretrainedBPETokenizer(words, bos="<s>", eos="</s>")
    assert encode_text(pretrained, "a</s>a") == pretrained.encode("a</s>a") == [2, 1, 2]
