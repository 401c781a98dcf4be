"""Decoding on a CUDA device gives what it gives on the CPU. Marked gpu: skipped where
torch sees no CUDA device (tests/conftest.py), run by `make test-gpu`."""

import copy

import pytest
import torch

from tformer.decoding.translate import SearchOptions
from tformer.models.seq2seq import Seq2Seq, Seq2SeqConfig
from tformer.registry import get_family

pytestmark = pytest.mark.gpu

V = 61


def on_both(model):
    """The model on the CPU, and a copy of it on the GPU."""
    return model.eval(), copy.deepcopy(model).to("cuda").eval()


@pytest.fixture(autouse=True)
def exact_matmuls():
    # TF32 would round the GPU's products to 10 bits of mantissa; the CPU keeps 23.
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("family", ["gpt", "transformer-xl"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_language_models_generate_the_same_tokens_on_gpu_and_cpu(family, use_cache):
    entry = get_family(family)
    cfg = entry.model_config(vocab_size=V, context=16, n_layer=2, n_head=2, d_model=32)
    cpu, gpu = on_both(entry.model(cfg))
    prompt = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(0))
    tokens = {}
    for name, model in (("cpu", cpu), ("gpu", gpu)):
        device = next(model.parameters()).device
        stream = entry.generate(model, prompt.to(device), max_new_tokens=24, temperature=0.0,
                                use_cache=use_cache)
        tokens[name] = torch.stack(list(stream), 1).cpu()
    assert torch.equal(tokens["gpu"], tokens["cpu"])
    with torch.no_grad():
        torch.testing.assert_close(gpu(prompt.cuda()).cpu(), cpu(prompt), atol=1e-4, rtol=1e-4)


def test_beam_search_translates_the_same_on_gpu_and_cpu():
    from tformer.data.tokenizers import train_tokenizer
    from tformer.decoding.translate import translate

    lines = ["one two three", "four five", "six"]
    tokenizer = train_tokenizer("char", lines, specials=True)
    cfg = Seq2SeqConfig(vocab_size=tokenizer.vocab_size, max_len=40, n_layer=2, n_head=2,
                        d_model=32, d_ff=64, dropout=0.0)
    cpu, gpu = on_both(Seq2Seq(cfg))
    options = SearchOptions(beam=4, alpha=0.6, max_len_a=2.0, n_best=2)
    got = {name: translate(model, tokenizer, lines, options) for name, model in
           (("cpu", cpu), ("gpu", gpu))}
    for a, b in zip(got["cpu"], got["gpu"], strict=True):
        assert [h.text for h in a] == [h.text for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)


@pytest.mark.parametrize("batch", [1, 3])
def test_speculative_decoding_on_the_gpu_keeps_plain_decodings_tokens(batch):
    """One row's caches are cut back after a rejection, a batch's are masked: both give the
    greedy tokens of plain decoding on the GPU."""
    from tformer.decoding.lm import generate
    from tformer.decoding.speculative import speculative_generate

    entry = get_family("gpt")
    torch.manual_seed(0)
    target = entry.model(entry.model_config(vocab_size=V, context=64, n_layer=2, n_head=2,
                                            d_model=32)).eval()
    draft = entry.model(entry.model_config(vocab_size=V, context=64, n_layer=1, n_head=2,
                                           d_model=16)).eval()
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [4, 4, 4, 4, 20, 21]][:batch]
    gpu_target, gpu_draft = copy.deepcopy(target).cuda(), copy.deepcopy(draft).cuda()
    expected = [[int(t[0]) for t in generate(gpu_target, torch.tensor([p], device="cuda"),
                                             max_new_tokens=20, temperature=0.0)]
                for p in prompts]
    for options in ({"draft": gpu_draft, "draft_tokens": 3}, {"lookup": 2, "draft_tokens": 4}):
        rows = [[] for _ in prompts]
        for new in speculative_generate(gpu_target, prompts, max_new_tokens=20,
                                        temperature=0.0, **options):
            for row, tokens in zip(rows, new, strict=True):
                row += tokens
        assert rows == expected
