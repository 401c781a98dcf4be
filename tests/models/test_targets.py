"""A model given Targets returns the loss of the logits it would have returned, with the
same gradients: the output layer and the loss taken together (kernels/xent.py) change the
memory a step holds, not what it computes."""

import pytest
import torch

from tformer.data.tokenizers import IGNORE_INDEX
from tformer.evaluation.loss import Targets
from tformer.kernels import xent
from tformer.models.gpt import GPT, GPTConfig
from tformer.models.seq2seq import Seq2Seq, Seq2SeqConfig
from tformer.models.transformer_xl import Memory, TransformerXL, TransformerXLConfig

V = 97


def gpt(**options):
    return GPT(GPTConfig(vocab_size=V, context=12, n_layer=2, n_head=2, d_model=16, **options))


def seq2seq():
    return Seq2Seq(Seq2SeqConfig(vocab_size=V, max_len=12, n_layer=2, n_head=2, d_model=16,
                                 d_ff=32, dropout=0.0))


def txl():
    return TransformerXL(TransformerXLConfig(vocab_size=V, context=6, mem_len=6, n_layer=2,
                                             n_head=2, d_model=16, d_ff=32, dropout=0.0))


def targets_of(shape, *, padded: bool = True) -> torch.Tensor:
    ids = torch.randint(0, V, shape)
    if padded:
        ids[0, :3] = IGNORE_INDEX  # prompt or padding: no loss
    return ids


def gradients(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def same_loss_and_gradients(model, run, targets: Targets) -> None:
    """run(targets or None) -> the model's output: the loss of the logits, through the
    targets path and through the logits."""
    model.train()
    fused = run(targets)
    fused.backward()
    fused_grads = gradients(model)
    unfused = targets.of_logits(run(None))
    unfused.backward()
    unfused_grads = gradients(model)
    torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-6)
    assert fused_grads.keys() == unfused_grads.keys() and fused_grads
    for name, grad in fused_grads.items():
        torch.testing.assert_close(grad, unfused_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture(params=[False, True], ids=["one chunk", "chunks of 5 rows"])
def chunked(request, monkeypatch):
    if request.param:
        monkeypatch.setattr(xent, "CHUNK_BYTES", 5 * V * 4)


@pytest.mark.parametrize("options", [{}, {"tie_embeddings": False, "output_bias": True}],
                         ids=["tied", "untied with a bias"])
def test_a_gpt_given_targets_returns_their_loss(options, chunked):
    torch.manual_seed(0)
    model, tokens = gpt(**options), torch.randint(0, V, (3, 12))
    same_loss_and_gradients(model, lambda t: model(tokens, targets=t),
                            Targets(targets_of((3, 12))))


def test_the_translation_model_given_targets_returns_their_smoothed_loss(chunked):
    torch.manual_seed(0)
    model = seq2seq()
    src, tgt = torch.randint(4, V, (3, 9)), torch.randint(4, V, (3, 7))
    src_real = torch.ones(3, 9, dtype=torch.bool)
    src_real[1, 6:] = False
    same_loss_and_gradients(model, lambda t: model(src, src_real, tgt, targets=t),
                            Targets(targets_of((3, 7)), smoothing=0.1))


def test_transformer_xl_given_targets_returns_their_loss_over_its_memory(chunked):
    torch.manual_seed(0)
    model = txl()
    first, second = torch.randint(0, V, (2, 6)), torch.randint(0, V, (2, 6))
    memory = Memory(6)
    with torch.no_grad():
        model(first, memory=memory)

    def run(targets):
        return model(second, memory=memory.copy(), targets=targets)

    same_loss_and_gradients(model, run, Targets(targets_of((2, 6), padded=False)))


def test_summed_targets_score_evaluation_as_the_logits_do():
    torch.manual_seed(0)
    model, tokens, ids = gpt().eval(), torch.randint(0, V, (2, 12)), targets_of((2, 12))
    with torch.no_grad():
        total = model(tokens, targets=Targets(ids, reduction="sum"))
        want = Targets(ids, reduction="sum").of_logits(model(tokens))
    torch.testing.assert_close(total, want)


def test_targets_score_a_model_that_takes_them_and_one_that_does_not():
    torch.manual_seed(0)
    model, tokens, ids = gpt().eval(), torch.randint(0, V, (2, 12)), targets_of((2, 12))
    logits_only = torch.nn.Embedding(V, V)  # a forward without `targets`: its logits scored
    targets = Targets(ids, reduction="sum")
    with torch.no_grad():
        torch.testing.assert_close(targets.score(model, tokens),
                                   targets.of_logits(model(tokens)))
        assert torch.equal(targets.score(logits_only, tokens),
                           targets.of_logits(logits_only(tokens)))
