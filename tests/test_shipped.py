"""A model as it is shipped: a run's best/ copied without trainer_state.pt (needed only to
resume) loads in every reader; --resume refuses it in one line; `export --format tformer`
makes that form on purpose, and it gives the same logits and the same tokenizer."""

import shutil

import pytest
import torch

import tformer
from tformer import loading
from tformer.cli import main
from tformer.config import config_from_dict
from tformer.training import checkpoint as ckpt
from tformer.training.trainer import train

GPT = ["model.n_layer=1", "model.n_head=2", "model.d_model=16", "model.context=16",
       "train.batch_size=4", "train.steps=4", "train.eval_every=2", "train.checkpoint_every=2",
       "train.device=cpu"]
SEQ2SEQ = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.d_ff=32",
           "model.max_len=40", "data.tokenizer=char", "data.builtin_pairs=100",
           "data.builtin_max=999", "data.max_tokens=400", "data.max_len=40",
           "data.max_ratio=12.0", "train.steps=2", "train.eval_every=2",
           "train.checkpoint_every=2", "train.device=cpu"]


def shipped_copy(run, dest):
    """The run's best/, copied as a user would, without its trainer state."""
    shutil.copytree(run / loading.BEST, dest, symlinks=False)
    (dest / loading.TRAINER_STATE).unlink()
    return dest


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("shipped")
    corpus = root / "tiny.txt"
    corpus.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 30)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TFORMER_CACHE", str(root / "cache"))
        train(config_from_dict({}, [f"data.path={corpus}", *GPT]), root / "gpt")
        train(config_from_dict({"model": {"family": "seq2seq"}}, SEQ2SEQ), root / "mt")
    copies = {"gpt": shipped_copy(root / "gpt", root / "gpt-shipped"),
              "mt": shipped_copy(root / "mt", root / "mt-shipped")}
    return {"gpt": root / "gpt", "mt": root / "mt", "corpus": corpus, "copies": copies}


def test_every_reader_loads_a_checkpoint_without_its_trainer_state(runs, tmp_path,
                                                                   monkeypatch, capsys):
    from fastapi.testclient import TestClient

    from tformer.serving import command as serving

    gpt, mt = runs["copies"]["gpt"], runs["copies"]["mt"]
    assert not (gpt / loading.TRAINER_STATE).exists()
    assert loading.TRAINER_STATE in (gpt / loading.MANIFEST).read_text()
    (tmp_path / "in.txt").write_text("123\n")
    commands = {
        "generate": ["generate", str(gpt), "--prompt", "Fir", "--max-new-tokens", "3"],
        "evaluate": ["evaluate", str(gpt), str(runs["corpus"]), "--json"],
        "translate": ["translate", str(mt), str(tmp_path / "in.txt"), "-o",
                      str(tmp_path / "out.txt"), "--beam", "1"],
        "info": ["info", str(gpt)],
        "export": ["export", str(gpt), "--format", "tformer", "--out", str(tmp_path / "x")],
        "attention": ["attention", str(gpt), "--text", "Fir", "-o", str(tmp_path / "a.png")],
    }
    for reader, args in commands.items():
        assert main(args) == 0, (reader, capsys.readouterr().err)
    tuned = config_from_dict({}, [*GPT, f"data.path={runs['corpus']}", f"train.init_from={gpt}",
                                  "train.steps=2"], inherit=ckpt.inherit_model)
    assert train(tuned, tmp_path / "tuned").step == 2

    answers = []

    class Server:  # serve's app, asked one question instead of listening on a port
        signalled = None

        def __init__(self, config):
            self.app = config.app

        def run(self):
            with TestClient(self.app) as client:
                answers.append(client.post("/v1/completions",
                                           json={"prompt": "Fir", "max_tokens": 2}).status_code)

    monkeypatch.setattr(serving, "draining_server_class", lambda: Server)
    assert main(["serve", str(gpt)]) == 0 and answers == [200]
    model = tformer.load(gpt, device="cpu")
    assert isinstance(model.generate("Fir", max_new_tokens=2, seed=0), str)
    assert tformer.load(mt, device="cpu").translate(["123"], beam=1)


def test_resume_refuses_a_shipped_checkpoint_in_one_line(runs, capsys):
    copy = runs["copies"]["gpt"]
    before = sorted(p.name for p in copy.iterdir())
    assert main(["train", "--resume", "--out", str(copy)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"no {loading.TRAINER_STATE}" in err, err
    assert f"train.init_from={copy}" in err
    assert sorted(p.name for p in copy.iterdir()) == before


def test_a_shipped_form_made_by_export_round_trips(runs, tmp_path, capsys):
    dest = tmp_path / "ship"
    assert main(["export", str(runs["gpt"]), "--format", "tformer", "--out", str(dest)]) == 0
    out = capsys.readouterr().out
    files = sorted(p.name for p in dest.iterdir())
    assert files == [loading.CONFIG, loading.MANIFEST, loading.WEIGHTS, loading.TOKENIZER]
    size = sum((dest / f).stat().st_size for f in files)
    assert f"{size / 2**20:.2f} MiB" in out and "as tformer" in out, out
    before, after = loading.load_checkpoint(runs["gpt"]), loading.load_checkpoint(dest)
    assert after.tokenizer.to_json() == before.tokenizer.to_json()
    tokens = torch.tensor([before.tokenizer.encode("First Citizen")])
    with torch.no_grad():
        assert torch.equal(after.model(tokens), before.model(tokens))
    assert after.cfg.to_dict() == before.cfg.to_dict()
    # The steps trained go with it, for `info` to show (4: the run's best).
    from tformer.viz.info import summarize

    assert summarize(dest)["step"] == summarize(runs["gpt"])["step"] == 4
    assert summarize(runs["copies"]["gpt"])["step"] == 4  # a copy without its trainer state
