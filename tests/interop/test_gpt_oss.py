"""gpt-oss from Hugging Face: a tiny random GptOssForCausalLM (attention sinks, biases,
YaRN, biased experts with the clamped gate, softmax after top-k; every layer full, or
sliding-window and full layers in turn as the released checkpoints have them) made by
transformers, saved, imported, and compared with transformers' forward pass and router."""

from __future__ import annotations

import pytest
import torch

from tformer.decoding.lm import generate, left_pad
from tformer.errors import TformerError
from tformer.interop import read_hf_config, read_hf_weights
from tformer.interop.gpt_oss import gpt_oss_config, gpt_oss_from_hf

from .test_llama import randomise

transformers = pytest.importorskip("transformers")

CONFIG = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 24,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 8, "num_local_experts": 6, "num_experts_per_tok": 2,
          "max_position_embeddings": 64, "layer_types": ["full_attention"] * 2,
          "tie_word_embeddings": False}


ALTERNATING = CONFIG | {"sliding_window": 4,
                        "layer_types": ["sliding_attention", "full_attention"]}
"""Every released gpt-oss's layers: sliding-window and full ones in turn, the window here
short enough that the prompts and their continuations pass it."""


def _saved(path, config_fields):
    config = transformers.GptOssConfig(**config_fields, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    randomise(model)
    with torch.no_grad():  # gates past the clamp's limit of 7 somewhere, and varied routes
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(20.0)
            layer.mlp.router.weight.mul_(8.0)
            layer.self_attn.sinks.copy_(torch.linspace(-2.0, 3.0, 4))
    model.save_pretrained(path)
    ours = gpt_oss_from_hf(read_hf_config(path), read_hf_weights(path), path)
    return path, model, ours


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return _saved(tmp_path_factory.mktemp("gpt-oss"), CONFIG)


@pytest.fixture(scope="module")
def alternating(tmp_path_factory):
    return _saved(tmp_path_factory.mktemp("gpt-oss-alternating"), ALTERNATING)


LAYOUTS = ["saved", "alternating"]
"""Every layer full; sliding and full layers in turn."""


@torch.no_grad()
def test_alternating_layers_are_a_window_with_every_second_layer_global(alternating):
    """The sliding layer slides and the full one does not, and the window matters to the
    comparisons with transformers below: read as full layers, the same weights compute
    otherwise."""
    path, _, ours = alternating
    assert (ours.cfg.window, ours.cfg.global_every) == (4, 2)
    assert [block.slides for block in ours.blocks] == [True, False]
    full = gpt_oss_from_hf(read_hf_config(path) | {"layer_types": ["full_attention"] * 2},
                           read_hf_weights(path), path)
    assert full.cfg.window is None
    tokens = torch.tensor([ROWS[0]])
    assert (full(tokens) - ours(tokens)).abs().max() > 1e-2


ROWS = [[5, 17, 3, 88, 41, 9, 62, 23, 7, 1, 54], [12, 6, 90], [33, 2, 71, 45, 8, 19, 60]]


@pytest.mark.parametrize("layout", LAYOUTS)
@torch.no_grad()
def test_logits_match_transformers_on_a_left_padded_batch(request, layout):
    _, hf, ours = request.getfixturevalue(layout)
    tokens, is_real = left_pad(ROWS, pad_id=0)
    got = ours(tokens, is_real)
    for i, row in enumerate(ROWS):
        expected = hf(torch.tensor([row])).logits[0]
        assert (got[i][is_real[i]] - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("layout", LAYOUTS)
@torch.no_grad()
def test_routes_greedy_tokens_and_cached_decoding(request, layout):
    _, hf, ours = request.getfixturevalue(layout)
    theirs, mine = {}, {}
    hooks = [layer.mlp.router.register_forward_hook(
        lambda m, i, out, n=n: theirs.__setitem__(n, out[2])) for n, layer in
        enumerate(hf.model.layers)]
    hooks += [block.ff.router.register_forward_hook(
        lambda m, i, out, n=n: mine.__setitem__(n, out[0])) for n, block in
        enumerate(ours.blocks)]
    tokens = torch.tensor([ROWS[0] + ROWS[2]])
    hf(tokens)
    ours(tokens)
    for hook in hooks:
        hook.remove()
    assert all(torch.equal(mine[n], theirs[n]) for n in theirs)
    assert len(theirs) == hf.config.num_hidden_layers
    seq = tokens[:, :5]
    for _ in range(15):  # greedy, as transformers' full forward pass picks each token
        seq = torch.cat([seq, hf(seq).logits[:, -1:].argmax(-1)], 1)
    got = torch.stack(list(generate(ours, tokens[:, :5], max_new_tokens=15,
                                    temperature=0.0)), 1)
    assert torch.equal(got, seq[:, 5:])
    cache = ours.make_cache(1)
    steps = [ours(tokens[:, :4], cache=cache)]
    steps += [ours(tokens[:, i : i + 1], cache=cache) for i in range(4, tokens.shape[1])]
    assert (torch.cat(steps, 1) - ours(tokens)).abs().max() < 1e-4


def test_the_sinks_and_the_clamp_matter(saved):
    """Without its sinks, or with its gate unclamped, the model computes otherwise: the
    comparisons above test both."""
    _, _, ours = saved
    tokens = torch.tensor([ROWS[0]])
    with torch.no_grad():
        base = ours(tokens)
        sinks = [block.attn.sinks.clone() for block in ours.blocks]
        for block in ours.blocks:
            block.attn.sinks.zero_()
        assert (ours(tokens) - base).abs().max() > 1e-2
        for block, kept in zip(ours.blocks, sinks, strict=True):
            block.attn.sinks.copy_(kept)
        glu = ours.blocks[0].ff.experts.glu
        glu.limit = 1e9
        assert (ours(tokens) - base).abs().max() > 1e-2
        glu.limit = 7.0


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 16},
     "sliding-window layers among full ones must alternate, sliding first"),
    ({"layer_types": ["sliding_attention", "chunked_attention"], "sliding_window": 16},
     "not one of sliding_attention and full_attention"),
    ({"layer_types": ["sliding_attention"] * 2, "sliding_window": None},
     "without a sliding_window"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantized as bitsandbytes"),
    ({"num_local_experts": None}, "has no num_local_experts"),
])
def test_what_is_not_expressed_is_named(saved, change, message):
    path, _, _ = saved
    with pytest.raises(TformerError, match=message):
        gpt_oss_config(read_hf_config(path) | change, path)


@pytest.mark.parametrize("layer_types, expected", [
    (["full_attention"] * 2, (None, 0)),
    (["sliding_attention"] * 2, (16, 0)),
    (["sliding_attention", "full_attention"], (16, 2)),
    (None, (16, 2)),  # GptOssConfig's default: alternating
])
def test_layer_types_map_to_the_window_and_the_global_layers(saved, layer_types, expected):
    path, _, _ = saved
    hf = read_hf_config(path) | {"layer_types": layer_types, "sliding_window": 16}
    cfg = gpt_oss_config(hf, path)
    assert (cfg.window, cfg.global_every if cfg.window else 0) == expected


def test_the_cli_imports_it_with_its_tokenizer(saved, tmp_path):
    from tformer.interop.command import import_checkpoint
    from tformer.loading import load_checkpoint

    from .test_llama import bpe_tokenizer

    _, hf, _ = saved
    hf.save_pretrained(tmp_path / "source")
    bpe_tokenizer().save_pretrained(tmp_path / "source")
    loaded = load_checkpoint(import_checkpoint(tmp_path / "source", tmp_path / "run"))
    assert loaded.model.cfg.attn_sinks and loaded.model.cfg.rope_scaling == "yarn"
    prompt = torch.tensor([loaded.tokenizer.encode("Kalo mi")])
    with torch.no_grad():
        expected = hf(prompt).logits
        assert (loaded.model(prompt) - expected).abs().max() <= 1e-5 * expected.abs().max()


@torch.no_grad()
def test_recorded_attention_leaves_the_sinks_share_out(saved):
    """Attention maps show the keys' probabilities alone: causal, and each row summing to
    less than 1 by the share its head's sink took."""
    _, _, ours = saved
    attn = ours.blocks[0].attn
    tokens = torch.tensor([ROWS[2]])
    attn.recorded = []
    try:
        ours(tokens)
        (probs,) = attn.recorded
    finally:
        attn.recorded = None
    T = len(ROWS[2])
    assert probs.shape == (1, 4, T, T)
    assert (probs.triu(1) == 0).all()
    total = probs.sum(-1)
    assert (total < 1 - 1e-4).all() and (total > 0).all()
    # The head whose sink is largest gives it the most.
    assert total.mean(-1).argmin() == attn.sinks.argmax()


def test_no_llama_layout_family_takes_it_for_its_own(saved):
    """Export as a Llama-layout family (folder or GGUF) names what gpt-oss has and they
    lack, rather than dropping it."""
    from dataclasses import replace

    from tformer.interop.llama import model_type_of

    _, _, ours = saved
    with pytest.raises(TformerError, match=r"attn_sinks = True.*expert_glu = 'clamped'"):
        model_type_of(ours.cfg)
    dense = replace(ours.cfg, n_expert=0, attn_bias=False)
    with pytest.raises(TformerError, match="attn_sinks = True"):
        model_type_of(dense)


@torch.no_grad()
def test_experts_in_mxfp4_blocks_are_read_as_transformers_reads_them():
    """The released checkpoints' form: experts as MXFP4 blocks and scales. Random ones,
    dequantized by transformers' own converter into its model, and by the import."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = transformers.GptOssConfig(**{**CONFIG, "intermediate_size": 32},
                                       attn_implementation="eager")
    torch.manual_seed(1)
    hf = transformers.GptOssForCausalLM(config).eval()
    randomise(hf)
    g = torch.Generator().manual_seed(2)
    weights = dict(hf.state_dict())
    for layer in range(2):
        for name, rows in (("gate_up_proj", 64), ("down_proj", 32)):
            key = f"model.layers.{layer}.mlp.experts.{name}"
            blocks = torch.randint(0, 256, (6, rows, 1, 16), dtype=torch.uint8, generator=g)
            scales = torch.randint(122, 128, (6, rows, 1), dtype=torch.uint8, generator=g)
            weights[key + "_blocks"], weights[key + "_scales"] = blocks, scales
            del weights[key]
            hf.get_parameter(key).copy_(convert_moe_packed_tensors(blocks, scales,
                                                                   dtype=torch.float32))
    raw = config.to_dict() | {"quantization_config": {"quant_method": "mxfp4"}}
    ours = gpt_oss_from_hf(raw, weights, "mxfp4")
    tokens = torch.tensor([ROWS[0]])
    expected = hf(tokens).logits
    assert (ours(tokens) - expected).abs().max() <= 1e-5 * expected.abs().max()


HARMONY = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}"
           "<|end|>{% endfor %}<|start|>assistant")
"""A template in the shape of gpt-oss's harmony format: the files carry it, and it travels."""


@pytest.fixture(scope="module")
def exported(alternating, tmp_path_factory):
    """The alternating model imported through the CLI's path and exported again."""
    from tformer.interop.command import export_checkpoint, import_checkpoint

    from .test_llama import bpe_tokenizer

    path, hf, _ = alternating
    source = tmp_path_factory.mktemp("gpt-oss-source")
    hf.save_pretrained(source)
    tokenizer = bpe_tokenizer()
    tokenizer.chat_template = HARMONY
    tokenizer.save_pretrained(source)
    run = import_checkpoint(source, tmp_path_factory.mktemp("gpt-oss-run") / "run")
    out = export_checkpoint(run, tmp_path_factory.mktemp("gpt-oss-out") / "hf")
    return source, out


@torch.no_grad()
def test_export_writes_a_folder_transformers_loads_with_the_same_logits(exported):
    """Chosen without --format (no Llama-layout family fits), loaded by transformers'
    own GptOssForCausalLM: the same tensors, bit for bit, and the same logits."""
    from safetensors.torch import load_file

    source, out = exported
    original = load_file(source / "model.safetensors")
    written = load_file(out / "model.safetensors")
    assert sorted(written) == sorted(original)
    assert all(torch.equal(written[k], original[k].float()) for k in original)
    hf = transformers.GptOssForCausalLM.from_pretrained(source, attn_implementation="eager")
    again = transformers.AutoModelForCausalLM.from_pretrained(out,
                                                              attn_implementation="eager")
    assert type(again).__name__ == "GptOssForCausalLM"
    assert again.config.layer_types == ["sliding_attention", "full_attention"]
    assert again.config.sliding_window == 4
    tokens = torch.tensor([ROWS[0]])
    expected = hf(tokens).logits
    assert (again(tokens).logits - expected).abs().max() <= 1e-5 * expected.abs().max()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.encode("Kalo mi") and tokenizer.chat_template == HARMONY


def test_export_names_what_gpt_oss_cannot_express(saved):
    from dataclasses import replace

    from tformer.interop.gpt_oss import hf_config

    _, _, ours = saved
    with pytest.raises(TformerError, match=r"gpt-oss cannot express this model: "
                                           r"model.attn_sinks = False"):
        hf_config(replace(ours.cfg, attn_sinks=False))
    with pytest.raises(TformerError, match="model.global_every = 3"):
        hf_config(replace(ours.cfg, window=8, global_every=3))
