import pytest
import torch

from tformer.decoding.lm import generate, left_pad
from tformer.models.gpt import GPT, GPTConfig


@pytest.fixture
def model() -> GPT:
    cfg = GPTConfig(vocab_size=23, context=12, n_layer=2, n_head=2, d_model=16)
    return GPT(cfg).eval()


def run(model, prompt, **kwargs):
    return torch.stack(list(generate(model, prompt, **kwargs)), dim=1)


@pytest.mark.parametrize("new_tokens", [5, 30])  # 30 slides well past the context of 12
def test_cached_generation_equals_uncached_token_for_token(model, new_tokens):
    prompt = torch.randint(0, 23, (3, 4))
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 5}):
        cached = run(model, prompt, max_new_tokens=new_tokens, use_cache=True,
                     generator=torch.Generator().manual_seed(1), **sampling)
        uncached = run(model, prompt, max_new_tokens=new_tokens, use_cache=False,
                       generator=torch.Generator().manual_seed(1), **sampling)
        assert torch.equal(cached, uncached)


def test_cached_generation_equals_a_manual_argmax_loop(model):
    prompt = torch.randint(0, 23, (1, 3))
    tokens = prompt
    for _ in range(6):
        nxt = model(tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    got = run(model, prompt, max_new_tokens=6, temperature=0.0)
    assert torch.equal(got, tokens[:, 3:])


def test_batched_left_padded_generation_equals_one_at_a_time(model):
    prompts = [[1, 2, 3, 4, 5], [6], [7, 8, 9]]
    ids, is_real = left_pad(prompts, pad_id=0)
    batched = run(model, ids, is_real=is_real, max_new_tokens=6, temperature=0.0)
    for row, prompt in enumerate(prompts):
        alone = run(model, torch.tensor([prompt]), max_new_tokens=6, temperature=0.0)
        assert torch.equal(batched[row], alone[0])


def test_generation_stops_at_eos(model):
    prompt = torch.randint(0, 23, (2, 3))
    first = run(model, prompt, max_new_tokens=1, temperature=0.0)[:, 0]
    eos = int(first[0])
    out = run(model, prompt, max_new_tokens=10, temperature=0.0, eos_id=eos)
    assert out[0].eq(eos).all(), "a finished row repeats eos"
    # It stops at the step where the second row too has produced eos, or after 10 tokens.
    free = run(model, prompt, max_new_tokens=10, temperature=0.0)
    hits = (free[1] == eos).nonzero()
    expected = int(hits[0]) + 1 if len(hits) else 10
    assert out.shape[1] == expected
    assert torch.equal(out[1], free[1, :expected]), "unfinished rows are unchanged"


def test_generation_stops_at_any_of_several_eos_ids(model):
    """Each row ends at the first of the ids it produces; a finished row repeats the first
    id of the list, whichever ended it."""
    prompt = torch.randint(0, 23, (2, 3))
    free = run(model, prompt, max_new_tokens=10, temperature=0.0)
    ends = (int(free[1, 4]), int(free[0, 1]))
    out = run(model, prompt, max_new_tokens=10, temperature=0.0, eos_id=ends)
    stops = [next(i for i, t in enumerate(row.tolist()) if t in ends) for row in free]
    assert out.shape[1] == max(stops) + 1
    for row, stop in enumerate(stops):
        assert torch.equal(out[row, : stop + 1], free[row, : stop + 1])
        assert out[row, stop + 1 :].eq(ends[0]).all()


def test_left_pad():
    ids, is_real = left_pad([[4, 5], [6]], pad_id=0)
    assert ids.tolist() == [[4, 5], [0, 6]]
    assert is_real.tolist() == [[True, True], [False, True]]
