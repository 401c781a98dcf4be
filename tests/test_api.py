"""tformer.load: the package's face runs the command line's paths, so it writes what the
command line writes, and its scores are the model's own next-token distribution."""

import json
from pathlib import Path

import pytest
import torch

import tformer
from tformer.cli import main

ROOT = Path(__file__).resolve().parents[1]
TEXT = "ROMEO:\nBefore we proceed any further, hear me speak.\n" * 40
GPT = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=16",
       "train.steps=4", "train.batch_size=2", "train.eval_every=2", "train.checkpoint_every=2",
       "train.device=cpu"]
SEQ2SEQ = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.d_ff=32",
           "data.builtin_pairs=200", "data.builtin_max=999", "data.max_tokens=400",
           "data.max_len=30", "train.steps=2", "train.eval_every=2", "train.checkpoint_every=2",
           "train.warmup_steps=1", "train.device=cpu"]


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("api")
    (tmp / "corpus.txt").write_text(TEXT, encoding="utf-8")
    out = tmp / "lm"
    assert main(["train", str(ROOT / "configs" / "gpt-builtin.toml"), "--out", str(out),
                 f"data.path={tmp / 'corpus.txt'}", *GPT]) == 0
    return out


@pytest.fixture(scope="module")
def s2s(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("api") / "s2s"
    assert main(["train", str(ROOT / "configs" / "seq2seq-builtin.toml"), "--out", str(out),
                 *SEQ2SEQ]) == 0
    return out


@pytest.mark.parametrize("weights, flags", [("fp32", ["--weights", "fp32"]), ("int8", ["--int8"])])
def test_generate_writes_what_the_command_line_writes(lm, capsys, weights, flags):
    model = tformer.load(lm, weights=weights, threads=1)
    text = model.generate("ROMEO:", max_new_tokens=30, temperature=0.9, top_k=5, seed=7)
    assert main(["generate", str(lm), "--prompt", "ROMEO:", "--max-new-tokens", "30",
                 "--temperature", "0.9", "--top-k", "5", "--seed", "7", "--threads", "1",
                 *flags]) == 0
    assert capsys.readouterr().out == "ROMEO:" + text + "\n"
    assert "".join(model.stream("ROMEO:", max_new_tokens=30, temperature=0.0)) == (
        model.generate("ROMEO:", max_new_tokens=30, temperature=0.0))


def test_score_is_the_log_probability_of_each_token_given_its_prefix(lm):
    model = tformer.load(lm, threads=1)
    text = "ROMEO:\nBefore we proceed any further, hear me"  # longer than the context, 16
    scores = model.score(text)
    ids = model.tokenizer.encode(text)
    assert [t for t, _ in scores] == [model.tokenizer.decode([i]) for i in ids[1:]]
    # Independently: each token from its own prefix (its last 16 tokens, as the windows of
    # 16 give them), one full forward pass each, in float64.
    module = tformer.loading.load_checkpoint(lm).model.double()
    for position in range(1, len(ids)):
        start = (position - 1) // 16 * 16
        prefix = torch.tensor([ids[start:position]])
        with torch.no_grad():
            logits = module(prefix)[0, -1].log_softmax(-1)
        assert scores[position - 1][1] == pytest.approx(float(logits[ids[position]]), abs=1e-5)


def test_score_averages_to_the_evaluated_loss(lm, tmp_path, capsys):
    text = "Before we proceed any further, hear me speak.\n"
    (tmp_path / "one.txt").write_text(text, encoding="utf-8")
    assert main(["evaluate", str(lm), str(tmp_path / "one.txt"), "--json"]) == 0
    import json

    evaluated = json.loads(capsys.readouterr().out)
    scores = tformer.load(lm).score(text)
    assert evaluated["tokens"] == len(scores)
    assert -sum(s for _, s in scores) / len(scores) == pytest.approx(evaluated["loss"], abs=1e-5)


def test_translate_writes_what_the_command_line_writes(s2s, tmp_path, capsys):
    lines = ["123", "45", "6"]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["translate", str(s2s), str(tmp_path / "in.txt"), "--beam", "3"]) == 0
    assert tformer.load(s2s).translate(lines, beam=3) == capsys.readouterr().out.splitlines()
    assert tformer.load(s2s).translate("123", beam=3) == tformer.load(s2s).translate(
        ["123"], beam=3)[0]


def test_start_up_lines_name_the_run_not_its_hidden_directories(lm, s2s, tmp_path, capsys):
    """best/ links to a hidden .best-<version> directory: what a user sees is the run."""
    (tmp_path / "in.txt").write_text("123\n", encoding="utf-8")
    lines = str(tmp_path / "in.txt")
    main(["generate", str(lm), "--max-new-tokens", "2"])
    main(["evaluate", str(lm)])
    main(["translate", str(s2s), lines, "--int8"])
    main(["info", str(lm)])
    both = capsys.readouterr()
    said = both.out + both.err
    assert ".best-" not in said
    assert f"generating with {lm.name}/best (gpt" in said
    # int8 weights are buffers, not parameters: the size is the model's all the same.
    assert main(["translate", str(s2s), lines]) == 0
    fp32 = capsys.readouterr().err
    size = fp32.split("beam 4, ")[1].split(";")[0]
    main(["translate", str(s2s), lines, "--int8"])
    assert f"beam 4, {size}, int8;" in capsys.readouterr().err


def test_load_refuses_a_model_of_the_wrong_kind(s2s):
    model = tformer.load(s2s)
    with pytest.raises(tformer.TformerError, match="does not generate"):
        model.generate("x")
    with pytest.raises(tformer.TformerError, match="generate needs a language model"):
        tformer.api.load(s2s, needs="generate")


def test_speculative_generation_writes_the_models_own_greedy_text(lm, capsys):
    import json

    base = ["generate", str(lm), "--prompt", "ROMEO:", "--max-new-tokens", "40", "--greedy"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--prompt-lookup", "2", "--draft-tokens", "3"]) == 0
    both = capsys.readouterr()
    assert both.out == plain and "drafted tokens accepted" in both.err
    assert main([*base, "--draft", str(lm), "--json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    result = json.loads(line)
    assert "ROMEO:" + result["text"] + "\n" == plain
    assert result["speculation"]["acceptance_rate"] == 1.0  # the model drafting for itself
    assert result["tokens"] == 40


def test_a_draft_of_another_vocabulary_is_one_line(lm, s2s, tmp_path, capsys):
    other = tmp_path / "other.txt"
    other.write_text("xyz " * 300, encoding="utf-8")
    small = tmp_path / "small"
    assert main(["train", str(ROOT / "configs" / "gpt-builtin.toml"), "--out", str(small),
                 f"data.path={other}", *GPT]) == 0
    capsys.readouterr()
    assert main(["generate", str(lm), "--draft", str(small)]) == 2
    assert "its tokenizer is not" in capsys.readouterr().err
    assert main(["generate", str(lm), "--draft", str(s2s)]) == 2
    assert "a draft is a language model" in capsys.readouterr().err
    assert main(["generate", str(lm), "--draft", str(lm), "--prompt-lookup", "2"]) == 2
    assert "choose one" in capsys.readouterr().err


def test_generate_follows_a_regex_as_the_command_line_does(lm, capsys, tmp_path):
    pytest.importorskip("llguidance")
    import re

    model = tformer.load(lm, threads=1)
    pattern = "(hear|speak) [a-f]{2,5}!"
    for seed in range(4):
        text = model.generate("ROMEO:", regex=pattern, temperature=1.0, seed=seed)
        assert re.fullmatch(pattern, text), text
    assert main(["generate", str(lm), "--prompt", "ROMEO:", "--regex", pattern, "--seed", "3",
                 "--temperature", "1", "--threads", "1"]) == 0
    assert capsys.readouterr().out == "ROMEO:" + model.generate(
        "ROMEO:", regex=pattern, temperature=1.0, seed=3) + "\n"
    schema = tmp_path / "schema.json"
    schema.write_text('{"enum": ["hear", 12]}')
    assert main(["generate", str(lm), "--json-schema", str(schema), "--num-samples", "2"]) == 0
    out = capsys.readouterr().out.split("\n")
    assert {json.loads(out[1]), json.loads(out[3])} <= {"hear", 12}
    # A schema the engine cannot compile, and a file that is not a schema: one line each.
    schema.write_text('{"type": "bogus"}')
    assert main(["generate", str(lm), "--json-schema", str(schema)]) == 2
    assert "Invalid type: bogus" in capsys.readouterr().err
    schema.write_text("{nope")
    assert main(["generate", str(lm), "--json-schema", str(schema)]) == 2
    assert "schema.json" in capsys.readouterr().err
    with pytest.raises(tformer.TformerError, match="not both"):
        model.generate("ROMEO:", regex="a", json_schema={"type": "string"})


def test_embed_pools_the_last_blocks_normed_states_to_unit_length(lm, s2s):
    """Independently: the full forward pass in float64, the states caught on their way to
    the vocabulary projection, averaged (or the last) and scaled to length 1."""
    model = tformer.load(lm, threads=1)
    texts = ["ROMEO:", "hear me speak"]
    module = tformer.loading.load_checkpoint(lm).model.double()
    caught = []
    module.lm_head.register_forward_hook(lambda m, inputs, out: caught.append(inputs[0][0]))
    for pooling in ("mean", "last"):
        got = model.embed(texts, pooling=pooling)
        assert got.shape == (2, 16) and got.dtype == torch.float32
        for text, vector in zip(texts, got, strict=True):
            caught.clear()
            with torch.no_grad():
                module(torch.tensor([model.prompt_ids(text)]))
            want = caught[0].mean(0) if pooling == "mean" else caught[0][-1]
            assert torch.allclose(vector.double(), want / want.norm(), atol=1e-5)
    assert torch.equal(model.embed("ROMEO:")[0], model.embed(texts)[0])
    with pytest.raises(tformer.TformerError, match="pooling 'max' is not one of mean, last"):
        model.embed(texts, pooling="max")
    with pytest.raises(tformer.TformerError, match="non-empty texts"):
        model.embed([""])
    with pytest.raises(tformer.TformerError, match="GPT-family"):
        tformer.load(s2s, threads=1).embed(["a man"])
