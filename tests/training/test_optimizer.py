"""train.optimizer: AdamW alone, or Muon for the blocks' matrices and AdamW for the rest."""

import copy

import pytest
import torch
import torch.nn.functional as F

from tformer.config import config_from_dict, load_config
from tformer.errors import TformerError
from tformer.registry import get_family
from tformer.training import checkpoint as ckpt
from tformer.training.optimizer import MuonWithAdamW, make_optimizer
from tformer.training.schedule import learning_rate
from tformer.training.trainer import train


def model_and_config(family, *extra):
    cfg = config_from_dict({}, [
        f"model.family={family}", "model.n_layer=1", "model.d_model=16", "model.n_head=2",
        "model.d_ff=32", "model.vocab_size=20", "train.optimizer=muon", "train.lr=1e-3",
        "train.min_lr=0.0", *extra,
    ])
    return get_family(family).model(cfg.model), cfg


def names_in(model, optimizer):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for group in optimizer.param_groups for p in group["params"]}


# Written out by hand from each model's layout, not from the rule.
MUON = {
    "gpt": {"blocks.0.attn.qkv_proj.weight", "blocks.0.attn.out_proj.weight",
            "blocks.0.ff.gate.weight", "blocks.0.ff.up.weight", "blocks.0.ff.down.weight"},
    "transformer-xl": {"blocks.0.attn.qkv_proj.weight", "blocks.0.attn.pos_proj.weight",
                       "blocks.0.attn.out_proj.weight", "blocks.0.ff.up.weight",
                       "blocks.0.ff.down.weight"},
    "seq2seq": {"encoder.0.attn.qkv_proj.weight", "encoder.0.attn.out_proj.weight",
                "encoder.0.ff.up.weight", "encoder.0.ff.down.weight",
                "decoder.0.self_attn.qkv_proj.weight", "decoder.0.self_attn.out_proj.weight",
                "decoder.0.cross_attn.q_proj.weight", "decoder.0.cross_attn.kv_proj.weight",
                "decoder.0.cross_attn.out_proj.weight", "decoder.0.ff.up.weight",
                "decoder.0.ff.down.weight"},
}
EXTRA = {"gpt": ["model.tie_embeddings=false", "model.feedforward=gated"]}


@pytest.mark.parametrize("family", list(MUON))
def test_muon_takes_the_blocks_matrices_and_adamw_the_rest(family):
    model, cfg = model_and_config(family, *EXTRA.get(family, []))
    optimizer = make_optimizer(model, cfg.train, torch.device("cpu"))
    assert isinstance(optimizer, MuonWithAdamW)
    to_muon, to_adamw = names_in(model, optimizer.muon), names_in(model, optimizer.adamw)
    assert to_muon == MUON[family]
    assert to_muon.isdisjoint(to_adamw)
    assert to_muon | to_adamw == {n for n, _ in model.named_parameters()}
    head = {"gpt": "lm_head.weight", "transformer-xl": "embed.weight",
            "seq2seq": "src_embed.weight"}[family]
    assert head in to_adamw


def test_a_model_without_matrices_in_blocks_cannot_take_muon():
    _, cfg = model_and_config("gpt")
    bigram = torch.nn.Sequential(torch.nn.Embedding(20, 20))
    with pytest.raises(TformerError, match="no trainable weight matrices in its blocks"):
        make_optimizer(bigram, cfg.train, torch.device("cpu"))


def test_steps_are_those_of_muon_and_adamw_built_by_hand():
    model, cfg = model_and_config("gpt", "train.weight_decay=0.1", "train.muon_lr=0.05",
                                  "model.tie_embeddings=false")
    before, by_hand = copy.deepcopy(model), copy.deepcopy(model)
    optimizer = make_optimizer(model, cfg.train, torch.device("cpu"))

    params = dict(by_hand.named_parameters())
    matrices = ["blocks.0.attn.qkv_proj.weight", "blocks.0.attn.out_proj.weight",
                "blocks.0.ff.up.weight", "blocks.0.ff.down.weight"]
    decayed = ["embed.weight", "positions.table.weight", "lm_head.weight"]
    rest = [p for n, p in params.items() if n not in matrices + decayed]
    muon = torch.optim.Muon([params[n] for n in matrices], lr=0.05, weight_decay=0.1)
    adamw = torch.optim.AdamW([{"params": [params[n] for n in decayed], "weight_decay": 0.1},
                               {"params": rest, "weight_decay": 0.0}],
                              lr=1e-3, betas=(0.9, 0.99), fused=True)
    tokens = torch.randint(0, 20, (3, 9))
    for step in range(3):
        rate = 1e-3 / (step + 1)  # a falling rate, as the trainer sets it
        for group in optimizer.param_groups:
            group["lr"] = rate * group.get("lr_scale", 1.0)
        muon.param_groups[0]["lr"] = 0.05 / (step + 1)
        for group in adamw.param_groups:
            group["lr"] = rate
        for net in (model, by_hand):
            logits = net(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        for opt in (optimizer, muon, adamw):
            opt.step()
            opt.zero_grad(set_to_none=True)
    for name, p in model.named_parameters():
        assert torch.equal(p, params[name]), name
        assert not torch.equal(p, before.get_parameter(name)), name


def test_the_trainer_runs_muon_at_muon_lr_on_the_schedule(tiny_config, tmp_path, monkeypatch):
    seen = []
    real_step = torch.optim.Muon.step

    def recording_step(self, closure=None):
        seen.append(self.param_groups[0]["lr"])
        return real_step(self, closure)

    monkeypatch.setattr(torch.optim.Muon, "step", recording_step)
    cfg = load_config(tiny_config(optimizer="muon", muon_lr=0.03, lr=3e-3, min_lr=3e-4,
                                  warmup_steps=2))
    train(cfg, tmp_path / "run")
    expected = [0.03 / 3e-3 * learning_rate(s, cfg.train, 0) for s in range(cfg.train.steps)]
    assert seen == pytest.approx(expected, rel=1e-12)
    assert seen[1] == pytest.approx(0.03) and seen[-1] == pytest.approx(0.003)


def test_muon_lowers_the_loss(tiny_config, tmp_path):
    cfg = load_config(tiny_config(optimizer="muon", steps=40, eval_every=20,
                                  checkpoint_every=20, lr=1e-2, min_lr=1e-3,
                                  model={"n_layer": 2, "d_model": 32}))
    result = train(cfg, tmp_path / "run")
    state = ckpt.load_trainer_state(tmp_path / "run" / "checkpoints" / "step-000040")
    assert set(state["optimizer"]) == {"muon", "adamw"} and state["optimizer_name"] == "muon"
    # The text's unigram entropy is 3.09 nats: below it, the model uses context.
    assert result.val_loss < 2.7


@pytest.mark.parametrize("overrides,message", [
    (["train.optimizer=sgd"], "'sgd' is not allowed; choose one of: adamw | muon"),
    (["train.optimizer=muon", "train.lora.r=4"], "a LoRA run trains its adapters only"),
    (["train.optimizer=muon", "train.parallel=fsdp"], "fsdp shards them; choose train.parallel"),
    (["train.muon_lr=-1"], "train.muon_lr = -1.0 must be at least 0.0"),
])
def test_what_muon_cannot_do_is_a_one_line_error(tiny_config, overrides, message):
    with pytest.raises(TformerError, match=message) as error:
        load_config(tiny_config(), overrides)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("before,after", [("adamw", "muon"), ("muon", "adamw")])
def test_resume_cannot_change_the_optimizer(tiny_config, tmp_path, before, after):
    train(load_config(tiny_config(optimizer=before, steps=3)), tmp_path / "run")
    latest = tmp_path / "run" / "checkpoints" / "step-000003"
    with pytest.raises(TformerError, match=f"cannot change train.optimizer from {before} to "):
        train(load_config(tiny_config(optimizer=after)), tmp_path / "run", resume_from=latest)
