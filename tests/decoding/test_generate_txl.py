import pytest
import torch

from tformer.decoding.lm import left_pad
from tformer.decoding.transformer_xl import generate_with_memory, read_prompt
from tformer.models.transformer_xl import Memory, TransformerXL, TransformerXLConfig

V = 23


def tiny(mem_len: int, **overrides) -> TransformerXL:
    cfg = TransformerXLConfig(vocab_size=V, context=4, mem_len=mem_len, n_layer=2, n_head=2,
                              d_model=16, **overrides)
    return TransformerXL(cfg).eval()


def run(model, prompt, n, **kwargs) -> torch.Tensor:
    return torch.stack(list(generate_with_memory(model, prompt, max_new_tokens=n, **kwargs)), 1)


def test_reading_the_prompt_in_segments_equals_one_pass():
    model = tiny(mem_len=16)
    prompt = torch.randint(0, V, (2, 11))
    memory = Memory(16)
    logits = read_prompt(model, prompt, memory)
    torch.testing.assert_close(logits, model(prompt)[:, -1:], atol=1e-5, rtol=1e-5)
    assert memory.length == 11


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_memory_as_cache_equals_recomputation_within_the_memory_window(norm):
    """Prompt 9 + 11 new tokens fit in mem_len + 1 = 21: nothing leaves the memory."""
    model = tiny(mem_len=20, norm=norm)
    prompt = torch.randint(0, V, (3, 9))
    cached = run(model, prompt, 11, temperature=0.0)
    uncached = run(model, prompt, 11, temperature=0.0, use_cache=False)
    assert torch.equal(cached, uncached)
    # And each step's choice is the argmax of one full causal pass over the text so far.
    text = torch.cat([prompt, cached], dim=1)
    full = model(text[:, :-1])[:, 8:]
    assert torch.equal(full.argmax(-1), cached)


def test_sampling_with_memory_follows_the_seed():
    model = tiny(mem_len=20)
    prompt = torch.randint(0, V, (2, 5))
    one = run(model, prompt, 8, generator=torch.Generator().manual_seed(1))
    two = run(model, prompt, 8, generator=torch.Generator().manual_seed(1), use_cache=False)
    assert torch.equal(one, two)


def test_each_new_token_reads_one_position_over_a_bounded_memory():
    model = tiny(mem_len=6)
    calls = []
    forward = model.forward

    def spy(tokens, is_real=None, *, memory=None, last_only=False):
        calls.append((tokens.shape[1], memory.length if memory is not None else None))
        return forward(tokens, is_real, memory=memory, last_only=last_only)

    model.forward = spy
    run(model, torch.randint(0, V, (1, 10)), 12, temperature=0.0)
    # The prompt in segments of 4, 4, 2; then one token at a time over at most 6 positions.
    assert [t for t, _ in calls[:3]] == [4, 4, 2]
    assert [m for _, m in calls[:3]] == [0, 4, 6]
    assert all(t == 1 and m == 6 for t, m in calls[3:])
    assert len(calls) == 3 + 11


def test_left_padded_prompts_generate_what_each_prompt_would_alone():
    model = tiny(mem_len=30)
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11]]
    ids, is_real = left_pad(prompts, pad_id=0)
    together = run(model, ids, 6, temperature=0.0, is_real=is_real)
    for row, prompt in enumerate(prompts):
        alone = run(model, torch.tensor([prompt]), 6, temperature=0.0)
        assert torch.equal(together[row], alone[0])


def test_eos_stops_generation():
    model = tiny(mem_len=8)
    prompt = torch.randint(0, V, (1, 3))
    first = int(run(model, prompt, 1, temperature=0.0)[0, 0])
    out = run(model, prompt, 10, temperature=0.0, eos_id=first)
    assert out.shape == (1, 1)
