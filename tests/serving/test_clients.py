"""Today's clients against a real `tformer serve` subprocess serving a run directory: the
model's name, the openai client's completions with log-probabilities, and
lm-evaluation-harness's remote tokenizer."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tformer.data.tokenizers import SPECIALS
from tformer.loading import load_checkpoint


@pytest.fixture(scope="module")
def client(run_server):
    return openai.OpenAI(base_url=run_server.url + "/v1", api_key="none", max_retries=0)


def test_the_model_is_the_run_not_its_hidden_checkpoint(run_server, client, gpt_run):
    hidden = Path(gpt_run / "best").resolve().name
    assert hidden.startswith(".best-")
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-run"]
    written = int((gpt_run / "best" / "config.json").stat().st_mtime)
    assert models[0].created == written and written <= time.time()
    assert client.models.retrieve("tiny-run").id == "tiny-run"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(hidden)
    answer = client.completions.create(model="tiny-run", prompt="a", max_tokens=2)
    assert answer.model == "tiny-run"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=hidden, prompt="a", max_tokens=2)


def test_openai_completions_with_logprobs_and_echo(client, gpt_run):
    loaded = load_checkpoint(gpt_run)
    text = "hello world"
    answer = client.completions.create(model="tiny-run", prompt=text, max_tokens=4,
                                       temperature=0, logprobs=2, echo=True)
    choice = answer.choices[0]
    assert choice.text.startswith(text)
    lp = choice.logprobs
    names = dict(zip(SPECIALS, range(len(SPECIALS)), strict=True))
    ids = [names[t] if t in names else loaded.tokenizer.encode(t)[0] for t in lp.tokens]
    assert loaded.tokenizer.decode(ids) == choice.text
    assert len(ids) == len(text) + 4 and lp.token_logprobs[0] is None
    with torch.no_grad():
        logp = torch.log_softmax(loaded.model(torch.tensor([ids])).float()[0], dim=-1)
    want = [float(logp[t - 1, ids[t]]) for t in range(1, len(ids))]
    # The server runs prepacked linear layers: equal within float rounding.
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    pieces = [len(loaded.tokenizer.decode([t])) for t in ids]  # specials take no room
    assert lp.text_offset == [sum(pieces[:i]) for i in range(len(ids))]
    assert all(len(top) <= 3 for top in lp.top_logprobs[1:])
    scored = client.completions.create(model="tiny-run", prompt=[ids[:5], ids[:3]],
                                       max_tokens=0, echo=True, logprobs=0)
    assert [c.text for c in scored.choices] == [text[:5], text[:3]]
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want[:4], abs=1e-4)


def test_the_remote_tokenizer_of_the_evaluation_harness(run_server, gpt_run):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    loaded = load_checkpoint(gpt_run)
    url = run_server.url + "/v1/completions"
    assert check_remote_tokenizer_support(url)
    remote = RemoteTokenizer(url)
    text = "the quick brown fox"
    assert remote.encode(text) == loaded.tokenizer.encode(text)
    assert remote.decode(loaded.tokenizer.encode(text)) == text
    assert remote.eos_token == "</s>" and remote.eos_token_id == loaded.tokenizer.eos_id
    info = httpx.get(run_server.url + "/tokenizer_info").json()
    assert info["model_max_length"] == 128 and info["vocab_size"] == loaded.tokenizer.vocab_size
    bad = httpx.post(run_server.url + "/detokenize", json={"tokens": [5, 10**6]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    unseen = httpx.post(run_server.url + "/tokenize", json={"prompt": "ÆØÅ"})
    assert unseen.status_code == 400 and unseen.json()["error"]["param"] == "prompt"
