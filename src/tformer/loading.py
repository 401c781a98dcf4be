"""Reading checkpoints for inference: find the checkpoint a path names, verify it against its
manifest, and load its model and tokenizer. Writing, rotating and resuming them belong to
training (training/checkpoint.py, which shares the layout defined here).

    RUN_DIR/
      config.json            the run's resolved config (what --resume continues)
      metrics.csv            one row per logged step or evaluation
      checkpoints/step-000250/
        config.json          family, hyperparameters, tokenizer kind
        model.safetensors    weights (tied tensors stored once)
        tokenizer.json
        chat_template.jinja  the tokenizer's chat template, where it has one (serve's chat)
        trainer_state.pt     optimizer, step, RNG states, data cursor (only --resume reads
                             it; a shipped model goes without: tformer export --format tformer)
        adapters.safetensors a LoRA run's adapters (train.lora); with train.init_from its
        lora_base.json       checkpoint holds no model.safetensors but this reference to
                             the base: its path and its weights' sha256
        manifest.json        size and sha256 of every file above
      best -> .best-<version>  the checkpoint with the lowest validation loss so far
      .lock                  held (flock) by the one process that writes the run

Readers may load a run while it trains. A checkpoint directory never changes once it is in
place; best/ is a symbolic link switched atomically to a new directory, and pruned step
checkpoints are renamed away before they are deleted. A reader resolves the link once, and
retries when what it resolved disappears under it, so it sees the old best or the new one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from tformer.config import RunConfig, config_from_dict
from tformer.data.tokenizers import Tokenizer, load_tokenizer
from tformer.errors import TformerError, shown
from tformer.kernels import blocks
from tformer.layers.experts import stack_experts
from tformer.registry import get_family

log = logging.getLogger(__name__)

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
TRAINER_STATE = "trainer_state.pt"
MANIFEST = "manifest.json"
ADAPTERS = "adapters.safetensors"
LORA_BASE = "lora_base.json"
CHECKPOINTS = "checkpoints"
BEST = "best"
STEP_DIR = re.compile(r"^step-(\d+)$")
READ_ATTEMPTS = 20
"""How often a reader tries again when a checkpoint is switched or pruned under it: a run
that saves a new best at every step can switch it several times while one load reads it,
and the waits between tries (0.05 s more each, at most READ_WAIT) let it finish a save."""
READ_WAIT = 0.2


def run_name(path: str | Path) -> str:
    """What a person calls the checkpoint at `path`: the run's directory name for a run or
    for a checkpoint inside one (best/, its hidden .best-<version> target, step-N/), else the
    checkpoint directory's own name; never the hidden version directory."""
    path = Path(path).absolute()
    if path.name == BEST or path.name.startswith(f".{BEST}-"):
        return path.parent.name
    if path.parent.name == CHECKPOINTS and STEP_DIR.match(path.name):
        return path.parent.parent.name
    return path.name


def describe_checkpoint(path: str | Path) -> str:
    """run_name, and which of the run's checkpoints it is: "demo/best", "demo/step-000250"."""
    path = Path(path).absolute()
    if path.parent.name == CHECKPOINTS and STEP_DIR.match(path.name):
        return f"{run_name(path)}/{path.name}"
    if path.name == BEST or path.name.startswith(f".{BEST}-"):
        return f"{run_name(path)}/{BEST}"
    return run_name(path)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_checkpoint(path: Path) -> None:
    """Raise TformerError naming the damaged file if the checkpoint is not as written.

    Every file the manifest lists must be there and as written, but trainer_state.pt: only
    `--resume` reads it (and checks for it), so a model shipped without it (config, weights,
    tokenizer, chat template) is whole."""
    path = Path(path)
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TformerError(f"checkpoint {path} is incomplete: {MANIFEST} is missing") from None
    except (OSError, ValueError, RecursionError) as e:
        raise TformerError(f"checkpoint file {manifest_path} is damaged: {e}") from None
    if not _manifest_is_well_formed(manifest):
        raise TformerError(
            f"checkpoint file {manifest_path} is damaged: expected an object mapping file "
            f'names to {{"bytes": integer, "sha256": string}}'
        )
    weights = LORA_BASE if LORA_BASE in manifest else WEIGHTS
    for name in (CONFIG, weights, TOKENIZER):
        if name not in manifest:
            raise TformerError(f"checkpoint {path} is incomplete: {name} is not in its manifest")
    for name, expected in manifest.items():
        file = path / name
        if name == TRAINER_STATE and not os.path.lexists(file):
            continue
        try:
            size = file.stat().st_size
            if not file.is_file():
                raise FileNotFoundError
            if size != expected["bytes"]:
                raise TformerError(
                    f"checkpoint file {file} is damaged: {size} bytes, "
                    f"{expected['bytes']} expected (truncated?)"
                )
            if sha256_of(file) != expected["sha256"]:
                raise TformerError(
                    f"checkpoint file {file} is damaged: its checksum does not match"
                )
        except FileNotFoundError:
            raise TformerError(f"checkpoint file {file} is missing") from None
        except OSError as e:
            raise TformerError(f"cannot read checkpoint file {file}: {e.strerror}") from None


def _manifest_is_well_formed(manifest: Any) -> bool:
    if not isinstance(manifest, dict):
        return False
    for name, entry in manifest.items():
        if "/" in name or name in ("", ".", "..") or not isinstance(entry, dict):
            return False
        size, digest = entry.get("bytes"), entry.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or not isinstance(digest, str):
            return False
    return True


def step_checkpoints(run_dir: Path) -> list[Path]:
    """A run's step checkpoints, oldest first."""
    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:06d}"


def is_checkpoint(path: Path) -> bool:
    return (Path(path) / MANIFEST).exists() or (Path(path) / WEIGHTS).exists()


def latest_good_checkpoint(run_dir: Path) -> Path | None:
    """The newest step checkpoint that verifies; damaged ones are skipped with a warning
    (one pruned while we looked is skipped quietly)."""
    for path in reversed(step_checkpoints(run_dir)):
        try:
            verify_checkpoint(path)
            return path
        except TformerError as e:
            if path.exists():
                log.warning("skipping damaged checkpoint: %s", e)
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """CKPT as the CLI takes it: a checkpoint directory, or a run directory (its best
    checkpoint if it has a good one, else its newest good step checkpoint). Links are
    resolved, so that what is read is one directory even if best/ switches meanwhile."""
    path = Path(path)
    if not path.exists():
        raise TformerError(f"checkpoint or run directory not found: {path}")
    if not path.is_dir():
        raise TformerError(f"{path} is not a directory (expected a run or checkpoint directory)")
    if is_checkpoint(path):
        return path.resolve() if path.is_symlink() else path
    best = path / BEST
    for _ in range(READ_ATTEMPTS):
        if not best.is_dir():
            break
        target = best.resolve()
        try:
            verify_checkpoint(target)
            return target
        except TformerError as e:
            if best.resolve() != target or not target.exists():
                continue  # training switched best/ while we read it
            log.warning("best checkpoint unusable, using the latest: %s", e)
            break
    latest = latest_good_checkpoint(path)
    if latest is None:
        raise TformerError(f"{path} holds no usable checkpoint")
    return latest


@dataclass
class Checkpoint:
    """A loaded checkpoint: `path` is the directory read (best/ resolved to its version),
    the names are those of the path the user gave."""

    path: Path
    cfg: RunConfig
    model: nn.Module
    tokenizer: Tokenizer
    name: str = ""
    """The run's name (run_name): what a server calls the model."""
    label: str = ""
    """The name and which checkpoint of the run (describe_checkpoint): what messages say."""


def read_config_json(path: Path) -> dict[str, Any]:
    """A checkpoint's config.json as it is: the run's config, and beside it the tokenizer's
    kind and size and the steps trained (`step`); missing or damaged, a TformerError."""
    file = Path(path) / CONFIG
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TformerError(f"checkpoint file {file} is missing") from None
    except (OSError, ValueError, RecursionError) as e:
        raise TformerError(f"checkpoint file {file} is damaged: {e}") from None
    if not isinstance(raw, dict):
        raise TformerError(f"checkpoint file {file} is damaged: it is not a JSON object")
    return raw


def read_config(path: Path) -> RunConfig:
    return config_of(read_config_json(path))


def config_of(raw: dict[str, Any]) -> RunConfig:
    """The run's config of a config.json read by read_config_json."""
    return config_from_dict({k: v for k, v in raw.items() if k not in ("tokenizer", "step")})


def tokenizer_kind(raw: dict[str, Any]) -> str | None:
    """The kind of tokenizer a checkpoint holds, as its config.json (read_config_json) names
    it."""
    return (raw.get("tokenizer") or {}).get("kind")


def load_checkpoint(
    path: str | Path, *, device: torch.device | str = "cpu", family: str | None = None,
    weights: str | None = None,
) -> Checkpoint:
    """Load a checkpoint (or a run's best/latest) as a model in eval mode.

    family: the family the caller needs; another one is a clear error, not a shape mismatch.
    weights: None keeps the weights a checkpoint holds as blocks (kernels/blocks.py) as
    they are; any format's name makes them fp32, for the caller to quantize as it asks.
    A checkpoint that training switched or pruned while it was read is looked up again.
    """
    for attempt in range(READ_ATTEMPTS):
        resolved = resolve_checkpoint(path)
        try:
            loaded = _load(resolved, device, family, weights)
            loaded.name, loaded.label = run_name(resolved), describe_checkpoint(resolved)
            return loaded
        except (TformerError, OSError, RuntimeError):
            moved = not resolved.exists() or _points_to(Path(path)) not in (resolved, None)
            if not moved or attempt == READ_ATTEMPTS - 1:
                raise
        time.sleep(min(READ_WAIT, 0.05 * (attempt + 1)))
    raise AssertionError("unreachable")


def _points_to(path: Path) -> Path | None:
    """Where `path` leads now, cheaply (no verification): itself or its link's target for
    a checkpoint, best/'s target for a run; None when that is not known."""
    if is_checkpoint(path):
        return path.resolve() if path.is_symlink() else path
    if (path / BEST).is_symlink():
        return (path / BEST).resolve()
    return None


def _load(path: Path, device: torch.device | str, family: str | None,
          weights: str | None = None) -> Checkpoint:
    verify_checkpoint(path)
    cfg = read_config(path)
    if family is not None and cfg.family != family:
        raise TformerError(
            f"checkpoint {path} is a {cfg.family} model; this command needs a {family} model"
        )
    tokenizer = load_tokenizer(path / TOKENIZER)
    with parameters_unmade():  # the checkpoint's weights fill them: no initial values
        model = get_family(cfg.family).model(cfg.model)
    make_parameters(model)
    held = stored_formats(path)
    blocks.hold_blocks(model, held)
    load_weights(model, path, device=device)
    if held and weights is not None:
        blocks.dequantize_model(model)
    if cfg.train.lora is not None:  # merged: a plain model now, and saved as one
        cfg = cfg.replace("train", lora=None)
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not all_finite(tensor):
            raise TformerError(
                f"checkpoint {path} holds non-finite weights ({name} has NaN or inf); "
                f"its outputs would not be finite"
            )
    model.to(device).eval()
    return Checkpoint(path, cfg, model, tokenizer)


def all_finite(tensor: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """Whether every value is finite, a million at a time (isfinite of the whole tensor
    would make a mask the size of the weights, at load time's peak)."""
    flat = tensor.detach().reshape(-1)
    return all(bool(torch.isfinite(part).all()) for part in flat.split(chunk))


@contextmanager
def parameters_unmade() -> Iterator[None]:
    """Build modules with their parameters on the meta device: no memory and no random
    initial values for weights a checkpoint is about to replace (a real model's fp32 weights
    would otherwise be made, drawn and thrown away: 540 MB for SmolLM2-135M). Buffers are
    made as usual. A parameter already on meta (a tied one, assigned again) stays the same
    object, so ties hold."""
    register = nn.Module.register_parameter

    def unmade(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    # Drawing initial values on meta does nothing, slowly (through torch's Python
    # references): skipped.
    inits = {name: getattr(nn.init, name) for name in INITS}

    def skipped(init: Any) -> Any:
        return lambda tensor, *args, **kwargs: (
            tensor if tensor.device.type == "meta" else init(tensor, *args, **kwargs))

    nn.Module.register_parameter = unmade  # type: ignore[method-assign]
    for name, init in inits.items():
        setattr(nn.init, name, skipped(init))
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
        for name, init in inits.items():
            setattr(nn.init, name, init)


INITS = ("normal_", "uniform_", "zeros_", "ones_", "constant_", "trunc_normal_",
         "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_")
"""torch.nn.init's functions the models' constructors call (nn.Linear's among them)."""


def make_parameters(model: nn.Module) -> None:
    """Give the parameters parameters_unmade left on meta uninitialised memory on the CPU
    (a tied parameter once), for a checkpoint's weights to be loaded into; a buffer left on
    meta (made from a parameter's values) is a bug, said at once."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.device.type == "meta":
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(torch.empty_like(param, device="cpu"),
                                                   requires_grad=param.requires_grad)
                module._parameters[name] = made[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type == "meta":
                raise RuntimeError(f"buffer {name} of {type(module).__name__} was made from "
                                   f"parameters that have no values yet")


def load_weights(
    model: nn.Module, path: Path, *, adapters: bool = True, device: torch.device | str = "cpu"
) -> None:
    """Checkpoint `path`'s weights into a plain `model` of its config. A LoRA checkpoint's
    base weights are its own model.safetensors or, where it holds adapters alone, those of
    the base it names (read the same way); `adapters` merges its adapters into them."""
    base = lora_base(path)
    if base is not None:
        load_weights(model, base, device=device)
    else:
        # Blocks into a plain model (training from an imported GGUF file, a LoRA run's
        # base): read as the file holds them, then made fp32. A mixture's experts held as
        # blocks one by one name no module of a plain model (its experts are stacked):
        # hold_blocks splits them, and they are stacked again once fp32.
        modules = dict(model.named_modules())
        plain = {param: fmt for param, fmt in stored_formats(path).items()
                 if not isinstance(modules.get(param.removesuffix(".weight")),
                                   (blocks.BlockLinear, blocks.StackedLinear,
                                    blocks.BlockEmbedding))}
        blocks.hold_blocks(model, plain)
        check_weight_shapes(path, model)
        try:
            read_weights(model, path / WEIGHTS)
        except (RuntimeError, SafetensorError, OSError, ValueError) as e:
            raise TformerError(f"checkpoint file {path / WEIGHTS} does not load: {e}") from None
        if plain:
            before = {id(p) for p in model.parameters()}
            blocks.dequantize_model(model)
            stack_experts(model)
            for p in model.parameters():  # made of the blocks: trained as the rest are
                if id(p) not in before:
                    p.requires_grad_(True)
    lora = read_config(path).train.lora
    if adapters and lora is not None:
        from tformer.training.lora import merge_adapters

        merge_adapters(model, path / ADAPTERS, lora)


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                      "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                      "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}
"""safetensors' dtype names read_weights reads itself (any other through safetensors)."""


def read_weights(model: nn.Module, file: Path) -> None:
    """A safetensors file's tensors into the model's own, in place, one at a time: each
    read from the file straight into the tensor's memory where it is a contiguous CPU
    tensor of the stored dtype, else through a tensor of its own, copied. No state dict
    of the whole model is made on the way (safetensors' load_model makes one, so that a
    model of 800 MB of blocks peaked at twice that while it loaded). The names and shapes
    are those check_weight_shapes has checked against the model; a tied tensor stored
    once fills each of its names."""
    targets = model.state_dict(keep_vars=True)
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        begin = 8 + size
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            target = targets[name].detach()
            start, end = entry["data_offsets"]
            dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
            if dtype is None:  # a dtype of safetensors' own: its reader
                with safe_open(str(file), framework="pt") as tensors:
                    with torch.no_grad():
                        target.copy_(tensors.get_tensor(name))
                continue
            into = target
            if not (target.dtype == dtype and target.device.type == "cpu"
                    and target.is_contiguous()):
                into = torch.empty(entry["shape"], dtype=dtype)
            if into.nbytes != end - start or list(into.shape) != entry["shape"]:
                raise ValueError(f"{name} is stored as {entry['dtype']} {entry['shape']}, "
                                 f"the model's is {target.dtype} {list(target.shape)}")
            f.seek(begin + start)
            if into.nbytes:
                read = f.readinto(memoryview(into.view(-1).view(torch.uint8).numpy()))
                if read != into.nbytes:
                    raise ValueError(f"{name} ends past the end of the file (truncated?)")
            if into is not target:
                with torch.no_grad():
                    target.copy_(into)


def base_reference(base: Path) -> dict[str, str]:
    """What a LoRA checkpoint records of the (verified) checkpoint its adapters were trained
    on: its path, and the sha256 of the file its weights are in (from its manifest)."""
    name = LORA_BASE if (base / LORA_BASE).is_file() else WEIGHTS
    manifest = json.loads((base / MANIFEST).read_text(encoding="utf-8"))
    return {"path": str(Path(base).absolute()), "file": name, "sha256": manifest[name]["sha256"]}


def lora_base(path: Path) -> Path | None:
    """The base checkpoint of a LoRA checkpoint that holds adapters alone, verified to be
    the one they were trained on; None for any other checkpoint."""
    file = Path(path) / LORA_BASE
    if not file.is_file():
        return None
    try:
        saved = json.loads(file.read_text(encoding="utf-8"))
        base = Path(saved["path"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TformerError(f"checkpoint file {file} is damaged: {e}") from None
    if not is_checkpoint(base):
        raise TformerError(f"checkpoint {path} holds LoRA adapters for the base checkpoint "
                           f"{base}, which is missing")
    verify_checkpoint(base)
    if base_reference(base) != saved:
        raise TformerError(f"checkpoint {path} holds LoRA adapters for the base checkpoint "
                           f"{base}, which has changed since (its weights' checksum differs)")
    return base


def stored_formats(path: Path) -> dict[str, str]:
    """{parameter name: block format} of the weights a checkpoint holds as blocks (the
    safetensors header's blocks.FORMATS_KEY); empty for fp32 checkpoints."""
    file = Path(path) / WEIGHTS
    if lora_base(path) is not None or not file.is_file():
        return {}
    try:
        with safe_open(str(file), framework="pt") as f:
            text = (f.metadata() or {}).get(blocks.FORMATS_KEY)
        formats = json.loads(text) if text is not None else {}
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise TformerError(f"checkpoint file {file} is damaged: {e}") from None
    if not (isinstance(formats, dict)
            and all(isinstance(v, str) and isinstance(k, str) for k, v in formats.items())):
        raise TformerError(f"checkpoint file {file}: {blocks.FORMATS_KEY} is not an object of "
                           f"parameter names and formats")
    return formats


def weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The tensors in a checkpoint's model.safetensors by name, read from its header."""
    file = Path(path) / WEIGHTS
    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise TformerError(f"checkpoint file {file} is damaged: {e}") from None


def check_weight_shapes(path: Path, model: nn.Module) -> None:
    """Every stored tensor must be one the model has, with its shape, and every tensor of
    the model must be stored (tied weights once, under any of their names). A LoRA
    checkpoint with adapters alone is checked when its base is read."""
    if lora_base(path) is not None:
        return
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    stored = weight_shapes(path)
    for name, shape in stored.items():
        if name not in expected:
            raise TformerError(
                f"checkpoint file {Path(path) / WEIGHTS} holds a tensor {shown(name)} that "
                f"its config's model does not have"
            )
        if shape != expected[name]:
            raise TformerError(
                f"checkpoint file {Path(path) / WEIGHTS}: {name} has shape {list(shape)}, "
                f"its config says {list(expected[name])}"
            )
    for names in shared_groups(model):
        if not names & stored.keys():
            raise TformerError(
                f"checkpoint file {Path(path) / WEIGHTS} lacks {shown(min(names))}, a tensor "
                f"of its config's model"
            )


def shared_groups(model: nn.Module) -> list[set[str]]:
    """The model's state-dict names, grouped by the tensor they name (tied weights)."""
    groups: dict[int, set[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), set()).add(name)
    return list(groups.values())
