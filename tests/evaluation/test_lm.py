import math

import numpy as np
import pytest
import torch

from tformer.data.tokenizers import CharTokenizer, train_tokenizer
from tformer.evaluation.lm import evaluate_stream
from tformer.evaluation.loss import lm_loss
from tformer.models.gpt import GPT, GPTConfig


def test_stream_metrics_equal_a_token_by_token_sum():
    text = "the quick brown fox jumps over the lazy dog. " * 3
    tok = CharTokenizer(text)
    ids = np.asarray(tok.encode(text), dtype=np.uint16)
    model = GPT(
        GPTConfig(vocab_size=tok.vocab_size, context=10, n_layer=1, n_head=2, d_model=8)
    ).eval()
    got = evaluate_stream(model, ids, tok, context=10, batch_size=4)

    # Reference: each target token t (t >= 1) predicted from the start of its window.
    nll = 0.0
    with torch.no_grad():
        for t in range(1, len(ids)):
            start = ((t - 1) // 10) * 10
            window = torch.tensor(ids[start:t].astype(np.int64))[None]
            logp = model(window)[0, -1].log_softmax(-1)
            nll -= logp[int(ids[t])].item()
    n = len(ids) - 1
    assert got["tokens"] == n
    assert got["loss"] == pytest.approx(nll / n, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    assert got["bpc"] == pytest.approx(nll / n / math.log(2), rel=1e-5)


def test_bpc_counts_characters_not_tokens_for_bpe():
    text = "abcabcabc abcabc abc\n" * 40
    tok = train_tokenizer("bpe", [text], vocab_size=270)
    ids = np.asarray(tok.encode(text), dtype=np.uint16)
    model = GPT(
        GPTConfig(vocab_size=tok.vocab_size, context=8, n_layer=1, n_head=2, d_model=8)
    ).eval()
    got = evaluate_stream(model, ids, tok, context=8, batch_size=4)

    # Reference: bits summed token by token, over the characters of the text after its
    # first token (which nothing predicts).
    bits = 0.0
    with torch.no_grad():
        for t in range(1, len(ids)):
            start = ((t - 1) // 8) * 8
            window = torch.tensor(ids[start:t].astype(np.int64))[None]
            bits -= model(window)[0, -1].log_softmax(-1)[int(ids[t])].item() / math.log(2)
    chars = len(text) - len(tok.decode([int(ids[0])]))
    assert chars != len(ids) - 1  # BPE: tokens are not characters
    assert got["bpc"] == pytest.approx(bits / chars, rel=1e-5)


def test_loss_ignores_padding_targets():
    logits = torch.randn(2, 3, 5)
    targets = torch.tensor([[1, 2, -100], [0, -100, -100]])
    expected = torch.stack(
        [
            -logits[0, 0].log_softmax(-1)[1],
            -logits[0, 1].log_softmax(-1)[2],
            -logits[1, 0].log_softmax(-1)[0],
        ]
    ).mean()
    torch.testing.assert_close(lm_loss(logits, targets), expected)
