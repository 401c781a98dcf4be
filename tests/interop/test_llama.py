"""Llama-layout models from Hugging Face (Llama with Llama 3's rope scaling, Qwen2 with tied
embeddings, Qwen3 with a head size of its own, Mistral with a window shorter than the
sequence): tiny random models saved with save_pretrained, imported, and compared with
transformers' own forward pass and generate."""

from __future__ import annotations

import pytest
import torch

from tformer.decoding.lm import generate, left_pad
from tformer.errors import TformerError
from tformer.interop import read_hf_config, read_hf_weights
from tformer.interop.llama import llama_config, llama_from_hf

transformers = pytest.importorskip("transformers")

COMMON = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "rms_norm_eps": 1e-6}
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_theta": 500000.0, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True,
                                                      "rope_theta": 1000.0}),
    "qwen3-head-dim": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 12,
                                                          "tie_word_embeddings": False}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 5,
                                                              "tie_word_embeddings": False}),
}


def randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter random, norm weights around 1, so that no mapping mistake hides
    behind ones."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.rand(p.shape, generator=g) - 0.5
            p.copy_(1.0 + 0.4 * noise if "norm" in name else 0.4 * noise)


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    config_class, model_class, fields = FAMILIES[request.param]
    config = getattr(transformers, config_class)(**COMMON, **fields,
                                                 attn_implementation="eager")
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    randomise(model)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, path, model


def imported(path):
    return llama_from_hf(read_hf_config(path), read_hf_weights(path), path)


ROWS = [[5, 17, 3, 88, 41, 9, 62, 23, 7, 1, 54], [12, 6, 90], [33, 2, 71, 45, 8, 19, 60]]


@torch.no_grad()
def test_logits_match_hugging_face_on_a_left_padded_batch(saved):
    name, path, hf = saved
    ours = imported(path)
    tokens, is_real = left_pad(ROWS, pad_id=0)
    got = ours(tokens, is_real)
    # Each row alone, as Hugging Face computes it: the left-padded batch must change nothing
    # (the window too counts real tokens only).
    for i, row in enumerate(ROWS):
        expected = hf(torch.tensor([row])).logits[0]
        delta = (got[i][is_real[i]] - expected).abs().max()
        assert delta <= 1e-5, (name, float(delta))
    if name != "mistral-window":  # Hugging Face's window counts the padding
        positions = (is_real.long().cumsum(1) - 1).clamp(min=0)
        expected = hf(tokens, attention_mask=is_real.long(), position_ids=positions).logits
        assert (got - expected).abs()[is_real].max() <= 1e-5


@torch.no_grad()
def test_greedy_tokens_match_hugging_face_generate(saved):
    name, path, hf = saved
    ours = imported(path)
    prompt = torch.tensor([ROWS[0][:4]])
    expected = hf.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[:, prompt.shape[1]:]
    got = torch.stack(list(generate(ours, prompt, max_new_tokens=20, temperature=0.0)), 1)
    assert torch.equal(got, expected), name


def test_the_config_maps_each_family_difference(saved):
    name, path, _ = saved
    cfg = llama_config(read_hf_config(path), path)
    assert (cfg.n_kv_head, cfg.norm_kind, cfg.feedforward, cfg.position) == (
        2, "rmsnorm", "gated", "none")
    assert cfg.rope_scaling == ("llama3" if name == "llama3" else "none")
    assert cfg.tie_embeddings == (name == "qwen2-tied")
    assert cfg.qkv_bias == (True if name == "qwen2-tied" else None)
    assert (cfg.qk_norm, cfg.d_head) == ((True, 12) if name == "qwen3-head-dim" else (False, None))
    assert cfg.window == (5 if name == "mistral-window" else None)


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gemma2"}, "model_type 'gemma2' is not one of"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "mscale": 0.7,
                       "original_max_position_embeddings": 32}}, "yarn's mscale"),
    ({"num_local_experts": 8}, "cannot express num_local_experts"),
    ({"hidden_act": "gelu"}, "cannot express hidden_act = gelu"),
    ({"hidden_size": None}, "config.json of a llama model has no hidden_size"),
])
def test_what_tformer_cannot_express_is_named(change, message, tmp_path):
    hf = {"model_type": "llama", **COMMON, "hidden_act": "silu", **change}
    with pytest.raises(TformerError, match=message):
        llama_config(hf, tmp_path)


def test_the_4x_config_form_reads_as_the_5x_one(saved):
    name, path, _ = saved
    hf = read_hf_config(path)
    params = dict(hf.pop("rope_parameters"))
    old = {**hf, "rope_theta": params.pop("rope_theta")}
    if params.get("rope_type", "default") != "default":
        old["rope_scaling"] = params
    assert llama_config(old, path) == llama_config(read_hf_config(path), path)


def bpe_tokenizer(specials: tuple[str, ...] = ()):
    """A byte-level BPE of 300 tokens trained here, <s> and </s> its ids 0 and 1 (and
    `specials` after them), as transformers' PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from .conftest import generated_text

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(generated_text(200), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>", *specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>")


def test_import_keeps_the_tokenizer_and_generates(saved, tmp_path):
    from tformer.interop.command import import_checkpoint
    from tformer.loading import load_checkpoint

    from .conftest import TRICKY

    name, path, hf = saved
    fast = bpe_tokenizer()
    source = tmp_path / "source"
    hf.save_pretrained(source)
    fast.save_pretrained(source)
    loaded = load_checkpoint(import_checkpoint(source, tmp_path / "ours"))
    reference = transformers.AutoTokenizer.from_pretrained(source)
    for text in [*TRICKY, "<s>a</s>"]:
        assert loaded.tokenizer.encode(text) == reference(text, add_special_tokens=False)[
            "input_ids"], text
    assert (loaded.tokenizer.bos_id, loaded.tokenizer.eos_id) == (0, 1)
    prompt = torch.tensor([loaded.tokenizer.encode("Kalo mi")])
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0,
                               eos_token_id=None)[:, prompt.shape[1]:]
        got = torch.stack(list(generate(loaded.model, prompt, max_new_tokens=20,
                                        temperature=0.0)), 1)
    assert torch.equal(got, expected), name

    # ...and back out: the same family, every tensor bit for bit, the same tokens.
    from tformer.interop.command import export_checkpoint

    back = export_checkpoint(tmp_path / "ours", tmp_path / "back", "llama")
    again = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    assert type(again) is type(hf)
    theirs, ours = hf.state_dict(), again.state_dict()
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs), name
    assert again.config.to_dict()["rope_parameters"] == hf.config.to_dict()["rope_parameters"]
    assert getattr(again.config, "sliding_window", None) == getattr(hf.config, "sliding_window",
                                                                    None)
    assert transformers.AutoTokenizer.from_pretrained(back)(TRICKY[1])["input_ids"] == (
        reference(TRICKY[1])["input_ids"])


def test_a_layout_no_family_has_is_refused_with_every_difference():
    from tformer.interop.llama import model_type_of
    from tformer.models.gpt import GPTConfig

    with pytest.raises(TformerError, match=r"model.position = 'learned' .*model.norm_kind"):
        model_type_of(GPTConfig(vocab_size=11))


# --- an instruct model: several end-of-text ids, a chat template -------------------------

CHAT = ("{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
        "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{% endif %}")
"""Llama 3's chat template, in small."""
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": " Kalo mi ré? "}]
PROMPT = "Kalo mi"


@pytest.fixture(scope="module")
def instruct(tmp_path_factory):
    """A tiny Llama whose generation_config.json ends a text at any of three ids, as Llama
    3's instruct models do: </s>, <|eom_id|> (which greedy decoding never draws) and the
    token greedy decoding draws at step k, the first that is new. config.json names </s>
    alone. Its tokenizer has a chat template. -> (directory, prompt ids, k)."""
    config_class, model_class, fields = FAMILIES["llama3"]
    config = getattr(transformers, config_class)(**COMMON, **fields, bos_token_id=0,
                                                 eos_token_id=1, attn_implementation="eager")
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    randomise(model)
    tokenizer = bpe_tokenizer(("<|eot_id|>", "<|eom_id|>"))
    tokenizer.chat_template = CHAT
    prompt = torch.tensor([tokenizer(PROMPT, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        free = model.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0,
                              eos_token_id=None)[0, prompt.shape[1]:].tolist()
    eom = tokenizer.convert_tokens_to_ids("<|eom_id|>")
    k = next(i for i in range(3, 20) if free[i] not in free[:i] and free[i] > eom)
    assert 1 not in free and eom not in free
    path = tmp_path_factory.mktemp("llama3-instruct")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(bos_token_id=0, eos_token_id=[1, eom, free[k]]).save_pretrained(
        path)
    return path, prompt, k


def test_generation_stops_at_any_eos_id_of_the_generation_config(instruct, tmp_path):
    """tformer's generate, the API (plain and speculative) and the exported model stop where
    transformers' generate stops with the same list: at the third id, after k + 1 tokens."""
    import tformer
    from tformer.interop.command import export_checkpoint, import_checkpoint
    from tformer.loading import load_checkpoint

    source, prompt, k = instruct
    ckpt = import_checkpoint(source, tmp_path / "ours")
    loaded = load_checkpoint(ckpt)
    generation = transformers.GenerationConfig.from_pretrained(source)
    assert loaded.tokenizer.eos_ids == tuple(generation.eos_token_id)
    assert loaded.tokenizer.eos_id == 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=20, do_sample=False,
                               pad_token_id=0)[0, prompt.shape[1]:]
        assert len(expected) == k + 1 and int(expected[-1]) == generation.eos_token_id[2]
        got = torch.stack(list(generate(loaded.model, prompt, max_new_tokens=20,
                                        temperature=0.0, eos_id=loaded.tokenizer.eos_ids)), 1)
    assert torch.equal(got[0], expected)
    model = tformer.load(ckpt)
    text = loaded.tokenizer.decode(expected.tolist())
    assert model.generate(PROMPT, max_new_tokens=20, temperature=0.0) == text
    assert model.generate(PROMPT, max_new_tokens=20, temperature=0.0, prompt_lookup=1) == text

    back = export_checkpoint(ckpt, tmp_path / "back", "llama")
    assert transformers.GenerationConfig.from_pretrained(back).eos_token_id == (
        generation.eos_token_id)
    assert transformers.AutoConfig.from_pretrained(back).eos_token_id == (
        generation.eos_token_id)
    again = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    with torch.no_grad():
        assert torch.equal(again.generate(prompt, max_new_tokens=20, do_sample=False,
                                          pad_token_id=0)[0, prompt.shape[1]:], expected)


def test_the_chat_template_survives_import_serve_and_export(instruct, tmp_path):
    """The template rendered by `tformer serve` from the imported checkpoint is the prompt
    transformers' apply_chat_template gives, from the source and from the export."""
    from tformer.data.chat import load_chat_template
    from tformer.interop.command import export_checkpoint, import_checkpoint
    from tformer.loading import load_checkpoint

    source, _, _ = instruct
    loaded = load_checkpoint(import_checkpoint(source, tmp_path / "ours"))
    assert (loaded.path / "chat_template.jinja").read_text() == CHAT
    ours = load_chat_template(loaded.path, None, {"bos_token": "<s>", "eos_token": "</s>"})
    back = export_checkpoint(loaded.path, tmp_path / "back", "llama")
    for directory in (source, back):
        want = transformers.AutoTokenizer.from_pretrained(directory).apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=True)
        assert ours.render(MESSAGES) == want, directory
    assert ours.end_of_turn == "<|eot_id|>"


@pytest.mark.parametrize("form", ["text", "named", "file"])
def test_each_form_of_a_hugging_face_chat_template_is_read(form, tmp_path):
    from tformer.interop import read_chat_template

    config = {"text": {"chat_template": CHAT},
              "named": {"chat_template": [{"name": "tool_use", "template": "{{ tools }}"},
                                          {"name": "default", "template": CHAT}]},
              "file": {"chat_template": "an older one, which the file replaces"}}[form]
    if form == "file":
        (tmp_path / "chat_template.jinja").write_text(CHAT)
    assert read_chat_template(tmp_path, config) == CHAT
    assert read_chat_template(tmp_path / "none", {}) is None
    with pytest.raises(TformerError, match="chat_template is neither a text"):
        read_chat_template(tmp_path / "none", {"chat_template": 3})


def test_an_eos_id_outside_the_tokenizer_is_a_one_line_error(instruct, tmp_path):
    import json
    import shutil

    from tformer.interop.command import import_checkpoint

    source = tmp_path / "source"
    shutil.copytree(instruct[0], source)
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4000]}))
    with pytest.raises(TformerError, match=r"source: end-of-text id 4000 is not a token"):
        import_checkpoint(source, tmp_path / "ours")


def test_readme_llama_example(instruct, tmp_path, monkeypatch, capsys):
    """The README's commands on the tiny instruct model: import, generate, a LoRA fine-tune
    that keeps the end-of-text ids and the chat template, and its export."""
    import json
    from pathlib import Path

    from tformer.cli import main
    from tformer.data.chat import load_chat_template
    from tformer.loading import load_checkpoint

    from .conftest import generated_text

    source, _, _ = instruct
    monkeypatch.chdir(tmp_path)
    lines = generated_text(40, seed=2)
    with open("instructions.jsonl", "w", encoding="utf-8") as f:
        for prompt, completion in zip(lines[::2], lines[1::2], strict=False):
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    config = readme.split("cat > smollm-lora.toml <<'END'\n")[1].split("END\n")[0]
    config = config.replace("steps = 200", "steps = 4").replace("warmup_steps = 20",
                                                                "warmup_steps = 1")
    Path("smollm-lora.toml").write_text(config + "eval_every = 2\ncheckpoint_every = 2\n")
    assert main(["import", str(source), "--out", "runs/smollm"]) == 0
    assert main(["generate", "runs/smollm", "--prompt", "The capital of France is",
                 "--greedy", "--max-new-tokens", "30"]) == 0
    assert main(["train", "smollm-lora.toml", "--out", "runs/smollm-lora",
                 "train.lora.r=8"]) == 0
    tuned = load_checkpoint("runs/smollm-lora")
    assert tuned.tokenizer.eos_ids == load_checkpoint("runs/smollm").tokenizer.eos_ids
    template = load_chat_template(tuned.path, None, {"bos_token": "<s>"})
    assert template is not None and template.source == CHAT
    capsys.readouterr()
    assert main(["info", "runs/smollm-lora"]) == 0
    shown = capsys.readouterr().out
    assert "end-of-text ids" in shown and "chat_template.jinja" in shown
    assert main(["export", "runs/smollm-lora", "--format", "llama", "--out",
                 "smollm-mine"]) == 0
    exported = transformers.AutoTokenizer.from_pretrained("smollm-mine")
    assert exported.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == (
        template.render(MESSAGES))
    eos = transformers.GenerationConfig.from_pretrained(source).eos_token_id
    assert transformers.GenerationConfig.from_pretrained("smollm-mine").eos_token_id == eos


def test_a_tokenizer_that_begins_texts_with_bos_does_so_through_import_serve_and_export(
        tmp_path):
    """A tokenizer.json whose post-processor begins each text with bos (Llama 2, Mistral,
    Llama 3): a prompt's ids, a scored text and the server's /tokenize begin with bos as
    transformers' tokenizer does; the export gives it back; and a tokenizer that says so
    without a post-processor (a GGUF file's) is exported with one."""
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer, processors

    import tformer
    from tformer.data.tokenizers import PretrainedBPETokenizer
    from tformer.interop.command import export_checkpoint, import_checkpoint
    from tformer.serving.app import create_app
    from tformer.serving.scheduler import LMEngine

    config_class, model_class, fields = FAMILIES["llama3"]
    config = getattr(transformers, config_class)(**COMMON, **fields, bos_token_id=0,
                                                 eos_token_id=1)
    torch.manual_seed(0)
    source = tmp_path / "source"
    getattr(transformers, model_class)(config).save_pretrained(source)
    plain = bpe_tokenizer()
    tok = Tokenizer.from_str(plain.backend_tokenizer.to_str())
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 0)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                         eos_token="</s>").save_pretrained(source)
    reference = transformers.AutoTokenizer.from_pretrained(source)
    text = "Kalo mi dun"
    expected = reference(text)["input_ids"]
    assert expected[0] == 0

    model = tformer.load(import_checkpoint(source, tmp_path / "ours"))
    assert model.tokenizer.add_bos and model.prompt_ids(text) == expected
    assert len(model.score(text)) == len(expected) - 1  # every token of the text
    engine = LMEngine(model.module, eos_id=1, max_batch=1, max_waiting=1, batched=True)
    with TestClient(create_app(engine, model.tokenizer, model_name="m", kind="lm")) as client:
        assert client.post("/tokenize", json={"prompt": text}).json()["tokens"] == expected
        assert client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}
                           ).json()["tokens"] == expected[1:]
    back = export_checkpoint(tmp_path / "ours", tmp_path / "back", "llama")
    assert transformers.AutoTokenizer.from_pretrained(back)(text)["input_ids"] == expected

    # As a GGUF file's vocabulary comes in: add_bos said, no post-processor.
    no_post = PretrainedBPETokenizer(Tokenizer.from_str(plain.backend_tokenizer.to_str()),
                                     bos="<s>", eos="</s>", add_bos=True)
    from tformer.interop import with_bos_template

    rebuilt = Tokenizer.from_str(with_bos_template(no_post))
    assert rebuilt.encode(text).ids == expected
