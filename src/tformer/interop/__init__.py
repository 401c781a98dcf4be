"""Import and export of other libraries' checkpoints, one file per source format; this
module holds what they share (reading a Hugging Face directory), tformer.interop.command
the entry points.

`import_checkpoint` (tformer.interop.command) reads a local Hugging Face model directory,
finds its format from config.json's `model_type`, and writes a tformer checkpoint
directory; `export_checkpoint` writes a tformer checkpoint back out in a format another
library loads. Nothing is downloaded: every source is a path.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tformer.data.tokenizers import CHAT_TEMPLATE, read_chat_template_file
from tformer.errors import TformerError

log = logging.getLogger(__name__)


def read_hf_config(src: Path) -> dict[str, Any]:
    path = Path(src) / "config.json"
    if not Path(src).is_dir():
        raise TformerError(f"{src} is not a directory (expected a Hugging Face model directory)")
    if not path.is_file():
        raise TformerError(f"{src} has no config.json: it is not a Hugging Face model directory")
    return read_json(path)


def read_json(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TformerError(f"cannot read {path}: {e}") from None
    if not isinstance(found, dict):
        raise TformerError(f"{path} is not a JSON object")
    return found


def special_ids(src: Path, hf: dict[str, Any], key: str) -> list[int]:
    """The ids generation_config.json and config.json give `{key}_token_id` ("bos", "eos",
    "pad"), each an id or a list of them; generation_config's first, as Hugging Face's
    generate reads it. Llama 3's instruct models end a text at any of three."""
    generation = src / "generation_config.json"
    found: list[int] = []
    for config in (read_json(generation) if generation.is_file() else {}, hf):
        value = config.get(f"{key}_token_id")
        found += [v for v in (value if isinstance(value, list) else [value])
                  if isinstance(v, int)]
    return list(dict.fromkeys(found))


def read_chat_template(src: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """A Hugging Face directory's chat template: its chat_template.jinja (which transformers
    prefers too), else tokenizer_config.json's `chat_template`, a text or a list of named
    ones (of which the "default"); None when it has none."""
    file = src / CHAT_TEMPLATE
    if file.is_file():
        return read_chat_template_file(file)
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            log.warning("%s: no chat template is named 'default' (%s); none is kept", src,
                        ", ".join(map(str, named)))
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise TformerError(f"{src}: tokenizer_config.json's chat_template is neither a text "
                           f"nor a list of {{name, template}}")
    return template


def adds_bos(tokenizer_json: dict[str, Any], bos: str | None) -> bool:
    """Whether a tokenizer.json (parsed) puts bos before each text it encodes: its
    post-processor's template for one text begins with bos (Llama 2, Mistral, Llama 3).
    Transformers reads a byte-level tokenizer.json so whatever tokenizer_config.json's
    `add_bos_token` says."""
    if bos is None:
        return False
    post = tokenizer_json.get("post_processor") or {}
    for step in post.get("processors", [post]):
        if step.get("type") == "TemplateProcessing":
            first = (step.get("single") or [{}])[0]
            return first.get("SpecialToken", {}).get("id") == bos
    return False


def with_bos_template(tokenizer: Any) -> str:
    """The tokenizer's tokenizer.json, made to begin each text with bos where the model
    reads texts so and the tokenizer's own post-processor does not already do it (a
    vocabulary read from a GGUF file), so that transformers encodes as tformer does."""
    from tokenizers import Tokenizer, processors

    text = tokenizer.tok.to_str()
    bos = tokenizer.names["bos"]
    if not tokenizer.add_bos or adds_bos(json.loads(text), bos):
        return text
    tok = Tokenizer.from_str(text)
    template = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, tokenizer.bos_id)])
    before = tok.post_processor
    tok.post_processor = template if before is None else processors.Sequence([before, template])
    return tok.to_str()


def export_token_ids(tokenizer: Any, names: dict[str, str | None]) -> dict[str, Any]:
    """`{key}_token_id` of the named special tokens, for config.json and
    generation_config.json: eos_token_id the list of every end-of-text id where the tokenizer
    has several (transformers' generate stops at any of a list)."""
    ids: dict[str, Any] = {f"{key}_token_id": tokenizer.tok.token_to_id(name)
                           for key, name in names.items() if name is not None}
    if len(tokenizer.eos_ids) > 1:
        ids["eos_token_id"] = list(tokenizer.eos_ids)
    return ids


def write_chat_template(tokenizer: Any, dest: Path, tokenizer_config: dict[str, Any]) -> None:
    """The tokenizer's chat template, if it has one, as dest/chat_template.jinja (what
    transformers 4.43 and later read) and in `tokenizer_config` (what older versions read)."""
    if tokenizer.chat_template is None:
        return
    (dest / CHAT_TEMPLATE).write_text(tokenizer.chat_template, encoding="utf-8")
    tokenizer_config["chat_template"] = tokenizer.chat_template


def read_hf_weights(src: Path) -> dict[str, Tensor]:
    """Every tensor of a Hugging Face model directory: model.safetensors (or its shards), or
    pytorch_model.bin read with weights_only=True (no code in a pickle runs)."""
    from safetensors.torch import load_file

    src = Path(src)
    if (src / "model.safetensors").is_file():
        return load_file(src / "model.safetensors")
    index = src / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        weights: dict[str, Tensor] = {}
        for shard in shards:
            weights.update(load_file(src / shard))
        return weights
    if (src / "pytorch_model.bin").is_file():
        try:
            return torch.load(src / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # an unpickling error names what it refused
            raise TformerError(f"cannot read {src / 'pytorch_model.bin'}: {e}") from None
    raise TformerError(f"{src} has no model.safetensors or pytorch_model.bin")


def take(weights: dict[str, Tensor], name: str, source: Path) -> Tensor:
    """weights[name], removed from `weights` (so that what is left over can be reported)."""
    try:
        return weights.pop(name)
    except KeyError:
        raise TformerError(f"{source}: the weights have no tensor {name!r}") from None


def gpt_of_state(cfg: Any, state: dict[str, Tensor], leftover: dict[str, Tensor],
                 source: Path | str) -> Any:
    """A GPT of `cfg` holding `state` (tformer's names), in eval mode: the tensors
    themselves, not copies, and no initial values drawn for weights they replace (an
    import holds each weight once). `leftover`: the source's tensors no name took, an error
    to report; a name the model has and `state` lacks (but a tied output layer's) is a
    mistake in the mapping itself. A tensor of `state` on the meta device stays there: the
    GGUF import's stand-in for a weight it then holds as the file's blocks."""
    from tformer.loading import parameters_unmade
    from tformer.models.gpt import GPT

    if leftover:
        raise TformerError(f"{source}: tensors tformer's GPT has no place for: "
                           f"{', '.join(sorted(leftover)[:5])}")
    with parameters_unmade():
        model = GPT(cfg)
    owned = {}
    for name, tensor in state.items():
        if tensor.device.type != "meta" and (not tensor.is_contiguous() or
                                             tensor.untyped_storage().nbytes() != tensor.nbytes):
            tensor = tensor.clone(memory_format=torch.contiguous_format)  # a view: its own
        owned[name] = tensor
    missing, unexpected = model.load_state_dict(owned, strict=False, assign=True)
    tied = cfg.tie_embeddings and "lm_head.weight" not in owned
    if unexpected or [k for k in missing if not (k == "lm_head.weight" and tied)]:
        raise AssertionError(f"mapping mismatch: {missing} {unexpected}")
    if tied:
        model.lm_head.weight = model.embed.weight
    return model.eval()


DECODER_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "max_position_embeddings")
"""The config.json keys every Hugging Face decoder's import reads."""


def require_ints(hf: dict[str, Any], keys: tuple[str, ...], source: Path | str) -> None:
    """One error naming every key of `keys` that config.json lacks (or holds as no int)."""
    missing = [key for key in keys if not isinstance(hf.get(key), int)]
    if missing:
        raise TformerError(f"{source}: config.json of a {hf.get('model_type')} model has no "
                           f"{', '.join(missing)}")
