"""Run configuration: three tables, [model], [data] and [train], read from TOML.

Each table becomes a frozen dataclass. The [model] and [data] classes belong to the family
named by `model.family`: `tformer.registry` hands them to this module when it registers the
family (`add_family`), so that this module imports no family, and no torch; [train] is
shared. Every value is checked when the dataclass is built, so a typo fails at load time
with the key's name, the bad value and what is allowed, never halfway through a run.

Command-line overrides are dotted `key=value` pairs (`model.n_layer=6 train.lr=3e-4`); the
value is read as a TOML literal when it is one (numbers, booleans, quoted strings) and as a
bare string otherwise, so `data.path=corpus.txt` needs no quotes.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from tformer.checks import check_choice, check_range
from tformer.errors import TformerError, did_you_mean, shown

Inherit = Callable[[str, Any, dict[str, Any]], tuple[str, dict[str, Any]]]
"""(train.init_from, the config's model.family or None, its [model] keys) -> the family and
the complete [model] table (tformer.training.checkpoint.inherit_model)."""

SECTIONS = ("model", "data", "train")


# --- the families' tables ----------------------------------------------------------------


@dataclass(frozen=True)
class FamilyTables:
    """What reading a config needs of a family: its [model] and [data] dataclasses."""

    model: type
    data: type
    noam_width: Callable[[Any], int] | None = None
    """(the [model] config) -> d_model, which the noam schedule scales by; None where the
    family has no such width."""


FAMILY_TABLES: dict[str, FamilyTables] = {}
"""By family name; filled by tformer.registry.register, one entry per registered family."""


def add_family(name: str, tables: FamilyTables) -> None:
    if name in FAMILY_TABLES:
        raise TformerError(f"a family named {name!r} is already registered")
    FAMILY_TABLES[name] = tables


def remove_family(name: str) -> None:
    del FAMILY_TABLES[name]


def family_tables(name: str) -> FamilyTables:
    try:
        return FAMILY_TABLES[name]
    except KeyError:
        known = " | ".join(FAMILY_TABLES) or "none registered (import tformer.registry)"
        raise TformerError(
            f"model.family = {name!r} is not known{did_you_mean(name, FAMILY_TABLES)}; "
            f"choose one of: {known}"
        ) from None


# --- the shared [train] table ------------------------------------------------------------

HIGHER_IS_BETTER = {"loss": False, "bleu": True, "chrf": True}
"""The validation metrics train.best_metric may name, and which way is better."""


@dataclass(frozen=True)
class LoRAConfig:
    """[train.lora]: low-rank adapters on the blocks' linear layers (Hu et al. 2021); the
    base weights stay frozen (tformer.training.lora)."""

    r: int = 8
    alpha: float = 16.0
    """The adapter's output is scaled by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapter's input."""
    targets: str | list[str] = "all"
    """The blocks' linear layers to adapt, by their last name (["qkv_proj", "out_proj"]), or
    "all" for every linear layer inside the blocks."""
    int8: bool = False
    """Keep the frozen weights of the blocks' linear layers as int8 rows while the adapters
    train (a quarter of their fp32 memory; int8 products forward and backward): CPU, fp32,
    with train.init_from. Checkpoints hold the adapters, merged into the fp32 base to load."""

    def __post_init__(self) -> None:
        check_range("train.lora.r", self.r, low=1)
        check_range("train.lora.alpha", self.alpha, low=0.0)
        check_range("train.lora.dropout", self.dropout, low=0.0, high=1.0)
        names = [self.targets] if isinstance(self.targets, str) else list(self.targets)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise TformerError(
                f"train.lora.targets = {self.targets!r}: give \"all\" or a list of the blocks' "
                f"linear layer names, e.g. [\"qkv_proj\", \"out_proj\"]"
            )
        # A tuple, so that the frozen config stays hashable.
        object.__setattr__(self, "targets", names[0] if names == ["all"] else tuple(names))



@dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000
    batch_size: int = 12
    """Sequences per step (seq2seq batches by `max_tokens` instead)."""
    accumulate: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    schedule: str = "cosine"
    optimizer: str = "adamw"
    """adamw: AdamW for every weight. muon: Muon for the blocks' weight matrices, AdamW for
    the embeddings, the output head, norms and biases (tformer.training.optimizer)."""
    muon_lr: float = 0.02
    """Muon's peak rate; the schedule scales it as it scales lr (Muon's rate is lr's times
    muon_lr / lr at every step)."""
    weight_decay: float = 0.1
    """On linear maps and embeddings; Muon's matrices too, decayed by its rate times this."""
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    """Largest global gradient norm; 0 turns clipping off."""
    eval_every: int = 250
    eval_batches: int = 0
    """Batches per evaluation during training; 0 evaluates the whole validation split."""
    checkpoint_every: int = 250
    keep_checkpoints: int = 2
    log_every: int = 10
    seed: int = 1337
    precision: str = "auto"
    """auto: bf16 autocast on a GPU that supports it, fp32 elsewhere."""
    device: str = "auto"
    compile: bool = False
    parallel: str = "ddp"
    """With several processes (torchrun): ddp replicates the model, fsdp shards it."""
    max_bad_steps: int = 10
    """Consecutive steps with a non-finite loss or gradient before training stops."""
    best_metric: str = "loss"
    """The validation metric that picks best/: loss (lower is better), or bleu / chrf
    (higher is better; translation with data.val_bleu_every)."""
    patience: int = 0
    """Stop after this many evaluations in a row that measured best_metric without
    improving it; 0 never stops early."""
    tensorboard: bool = False
    """Also write the logged scalars as TensorBoard event files in RUN_DIR/tensorboard
    (needs `pip install 'tformer[viz]'`); metrics.csv is written either way."""
    init_from: str | None = None
    """A checkpoint (or run) whose weights and tokenizer the run starts from, with a fresh
    optimizer and schedule: fine-tuning. The model fields come from it."""
    lora: LoRAConfig | None = None
    """[train.lora]: train low-rank adapters only; none trains every weight."""

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "accumulate", "eval_every", "checkpoint_every"):
            check_range(f"train.{key}", getattr(self, key), low=1)
        for key in ("keep_checkpoints", "log_every", "max_bad_steps"):
            check_range(f"train.{key}", getattr(self, key), low=1)
        check_range("train.warmup_steps", self.warmup_steps, low=0)
        check_range("train.patience", self.patience, low=0)
        check_choice("train.best_metric", self.best_metric, tuple(HIGHER_IS_BETTER))
        check_range("train.eval_batches", self.eval_batches, low=0)
        check_range("train.lr", self.lr, low=0.0)
        check_range("train.min_lr", self.min_lr, low=0.0, high=self.lr)
        check_range("train.weight_decay", self.weight_decay, low=0.0)
        check_range("train.beta1", self.beta1, low=0.0, high=1.0)
        check_range("train.beta2", self.beta2, low=0.0, high=1.0)
        check_range("train.grad_clip", self.grad_clip, low=0.0)
        check_choice("train.schedule", self.schedule, ("cosine", "linear", "noam", "constant"))
        check_choice("train.precision", self.precision, ("auto", "fp32", "bf16"))
        check_choice("train.parallel", self.parallel, ("ddp", "fsdp"))
        check_choice("train.optimizer", self.optimizer, ("adamw", "muon"))
        check_range("train.muon_lr", self.muon_lr, low=0.0)
        if self.optimizer == "muon":
            self.check_muon()
        if self.lora is not None and self.lora.int8:
            self.check_lora_int8()
        if self.device not in ("auto", "cpu") and not self.device.startswith(("cuda", "mps")):
            raise TformerError(
                f"train.device = {self.device!r} is not allowed; choose auto, cpu, cuda or cuda:N"
            )

    def check_muon(self) -> None:
        """What Muon cannot be combined with (one line each)."""
        if self.lora is not None:
            # Every weight but the adapters is frozen: nothing would be left for Muon.
            raise TformerError(
                "train.optimizer = muon trains the blocks' full weight matrices, and a LoRA "
                "run trains its adapters only (with AdamW); choose train.optimizer = adamw"
            )
        if self.parallel == "fsdp":
            # Newton-Schulz needs each whole matrix; FSDP leaves each rank a slice of rows.
            raise TformerError(
                "train.optimizer = muon needs each weight matrix whole, and train.parallel = "
                "fsdp shards them; choose train.parallel = ddp"
            )

    def check_lora_int8(self) -> None:
        """What train.lora.int8 cannot be combined with (one line each); a device that
        train.device = auto finds is checked when the run starts (lora.add_adapters)."""
        if self.init_from is None:
            # A LoRA run from scratch saves its frozen base, which int8 keeps only rounded.
            raise TformerError(
                "train.lora.int8 needs train.init_from (the checkpoint to adapt): a LoRA run "
                "from scratch saves its base weights, which int8 keeps only rounded"
            )
        if self.precision == "bf16" or self.device.startswith(("cuda", "mps")):
            raise TformerError(
                f"train.lora.int8 trains on the CPU in fp32 (int8 products of fp32 rows); "
                f"got train.precision = {self.precision}, train.device = {self.device}"
            )
        if self.parallel == "fsdp":
            raise TformerError(
                "train.lora.int8 keeps each frozen weight whole on every process, and "
                "train.parallel = fsdp shards them; choose train.parallel = ddp"
            )


# --- the whole run -----------------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    family: str
    model: Any
    data: Any
    train: TrainConfig

    def __post_init__(self) -> None:
        tables = FAMILY_TABLES.get(self.family)
        if self.train.schedule == "noam" and (tables is None or tables.noam_width is None):
            raise TformerError(
                f"train.schedule = noam scales the rate by model.d_model, which a "
                f"{self.family} model does not have; choose cosine, linear or constant"
            )

    def to_dict(self) -> dict[str, Any]:
        model = {"family": self.family, **dataclasses.asdict(self.model)}
        return {
            "model": model,
            "data": dataclasses.asdict(self.data),
            "train": dataclasses.asdict(self.train),
        }

    def replace(self, section: str, **changes: Any) -> RunConfig:
        """A copy with some fields of one table changed (and validated again)."""
        return dataclasses.replace(
            self, **{section: dataclasses.replace(getattr(self, section), **changes)}
        )


def build_dataclass(cls: type, values: Mapping[str, Any], section: str) -> Any:
    """cls(**values) with unknown keys and wrong types reported by name."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise TformerError(
                f"unknown key {section}.{shown(key)}{did_you_mean(key, fields)}; "
                f"known keys: {', '.join(fields)}"
            )
        kwargs[key] = _coerce(f"{section}.{key}", value, hints[key])
    return cls(**kwargs)


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check `value` against a field's annotation; ints are accepted where floats are."""
    allowed = typing.get_args(hint) if _is_union(hint) else (hint,)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
        if type(None) in allowed:
            return None
    for kind in allowed:
        if dataclasses.is_dataclass(kind) and isinstance(value, Mapping):  # a nested table
            return build_dataclass(kind, value, key)
        if typing.get_origin(kind) is list and isinstance(value, (list, tuple)):
            item = typing.get_args(kind)[0]
            return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is str and isinstance(value, str):
            return value
    names = " or ".join(_type_name(k) for k in allowed)
    raise TformerError(f"{key} = {value!r} has the wrong type; expected {names}")


def _type_name(kind: Any) -> str:
    if kind is type(None):
        return "none"
    if dataclasses.is_dataclass(kind):
        return "a table"
    return str(kind) if typing.get_origin(kind) else kind.__name__


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def parse_override(text: str) -> tuple[str, str, Any]:
    """'train.lr=3e-4' -> ('train', 'lr', 3e-4)."""
    key, sep, raw = text.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not name:
        raise TformerError(
            f"override {text!r} is not of the form section.key=value (e.g. train.lr=3e-4)"
        )
    if section not in SECTIONS:
        raise TformerError(
            f"override {text!r}: unknown table {section!r}{did_you_mean(section, SECTIONS)}; "
            f"tables: {', '.join(SECTIONS)}"
        )
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    except RecursionError:
        raise TformerError(f"override {shown(key)}: its value is nested too deeply") from None
    return section, name, value


def config_from_dict(
    raw: Mapping[str, Any], overrides: Iterable[str] = (), *, inherit: Inherit | None = None
) -> RunConfig:
    """Build and validate a RunConfig from parsed TOML/JSON tables plus overrides.

    inherit: for the config of a run about to start, whose [model] table a checkpoint named
    by train.init_from completes (tformer.training.checkpoint.inherit_model; a saved run's
    config is complete already, and is read without it).
    """
    if not isinstance(raw, Mapping):
        raise TformerError("a config must be a table with [model], [data] and [train]")
    for section in raw:
        if section not in SECTIONS:
            raise TformerError(
                f"unknown table [{shown(section)}]{did_you_mean(section, SECTIONS)}; "
                f"tables: {', '.join(SECTIONS)}"
            )
    tables: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        table = raw.get(section, {})
        if not isinstance(table, Mapping):
            raise TformerError(f"[{section}] must be a table of key = value pairs")
        tables[section] = dict(table)
    for text in overrides:
        section, name, value = parse_override(text)
        # train.lora.r=16 sets a key of the nested [train.lora] table, making it if need be.
        *path, name = name.split(".")
        table = tables[section]
        for part in path:
            if not isinstance(table.get(part), Mapping):
                table[part] = {}
            table[part] = table = dict(table[part])
        table[name] = value

    family_name = tables["model"].pop("family", None)
    if inherit is not None and tables["train"].get("init_from") is not None:
        family_name, tables["model"] = inherit(
            str(tables["train"]["init_from"]), family_name, tables["model"]
        )
    family_name = "gpt" if family_name is None else family_name
    if not isinstance(family_name, str):
        raise TformerError(f"model.family = {family_name!r} must be a string")
    family = family_tables(family_name)
    return RunConfig(
        family=family_name,
        model=build_dataclass(family.model, tables["model"], "model"),
        data=build_dataclass(family.data, tables["data"], "data"),
        train=build_dataclass(TrainConfig, tables["train"], "train"),
    )


def load_config(
    path: str | Path, overrides: Iterable[str] = (), *, inherit: Inherit | None = None
) -> RunConfig:
    """Read a TOML (or a checkpoint's JSON) config file for a new run, and apply overrides."""
    path = Path(path)
    if not path.is_file():
        raise TformerError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
        raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except UnicodeDecodeError as e:
        raise TformerError(f"config file {path} is not UTF-8 text") from e
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise TformerError(f"config file {path} does not parse: {e}") from e
    except RecursionError:
        raise TformerError(f"config file {path} does not parse: it is nested too deeply") from None
    return config_from_dict(raw, overrides, inherit=inherit)
