"""tformer from Python: a checkpoint loaded once, then generate, translate or score with it,
on the same paths as the command line (the weight format, the decoding thread rule).

    import tformer

    model = tformer.load("runs/shakespeare")
    print(model.generate("ROMEO:", max_new_tokens=100, temperature=0.8, seed=1))
    for token, logprob in model.score("To be, or not to be"):
        ...

    de = tformer.load("runs/multi30k", weights="int8")
    de.translate(["A man is riding a bike."], beam=4)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, overload

from tformer.arguments import Help
from tformer.errors import TformerError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from tformer.decoding.constraints import Matcher
    from tformer.decoding.sampling import ExtraSampling
    from tformer.decoding.speculative import SpeculationStats
    from tformer.loading import Checkpoint
    from tformer.registry import Family


@dataclass(frozen=True)
class Sampling:
    """The defaults of sampling, for the API and `tformer generate` alike."""

    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1337


SAMPLING = Sampling()


def check_generation_args(
    max_new_tokens: int, temperature: float, top_k: int, top_p: float, num_samples: int = 1
) -> None:
    if max_new_tokens < 1:
        raise TformerError(f"--max-new-tokens {max_new_tokens} must be at least 1")
    if not temperature >= 0:
        raise TformerError(f"--temperature {temperature} must be 0 (greedy) or more")
    if top_k < 0:
        raise TformerError(f"--top-k {top_k} must be 0 (off) or more")
    if not 0 < top_p <= 1:
        raise TformerError(f"--top-p {top_p} must be in (0, 1]")
    if num_samples < 1:
        raise TformerError(f"--num-samples {num_samples} must be at least 1")


class FormatNames(Sequence[str]):
    """The weight formats' names (kernels/formats.py's FORMATS), read when argparse first
    asks for them (a name to check, --help): the registry imports torch, which a command
    loads only once it runs."""

    def _names(self) -> tuple[str, ...]:
        from tformer.kernels.formats import FORMATS, MIXES

        return (*FORMATS, *MIXES)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...
    def __getitem__(self, index):  # noqa: ANN001, ANN204 (Sequence's)
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())


# The weight format, as every command that decodes takes it (`--int8` is `--weights int8`).
Weights = Annotated[
    str | None, Help("the linear layers' weight format, one of %(choices)s (default: the "
                     "checkpoint's own, blocks as it holds them, else fp32)", metavar="NAME",
                     choices=FormatNames(), alias=("--int8", "int8"))
]

# Speculative decoding's options, as `tformer generate` and `tformer serve` both take them.
Draft = Annotated[
    str | None, Help("speculative decoding: a small model of the same tokenizer drafts, this "
                     "one verifies (same output distribution)", metavar="CKPT")
]
DraftTokens = Annotated[int, Help("tokens drafted a round (--draft, --prompt-lookup)")]
PromptLookup = Annotated[
    int, Help("speculative decoding without a draft model: propose what followed the last N "
              "tokens' earlier occurrence in the text (0 is off)", metavar="N")
]
DRAFT_TOKENS = 4


def check_speculation_args(draft: str | None, draft_tokens: int, prompt_lookup: int) -> None:
    if draft is not None and prompt_lookup:
        raise TformerError("--draft and --prompt-lookup are two ways to draft; choose one")
    if prompt_lookup < 0:
        raise TformerError(f"--prompt-lookup {prompt_lookup} must be 1 or more (0 is off)")
    if draft_tokens < 1:
        raise TformerError(f"--draft-tokens {draft_tokens} must be at least 1")


def check_draft(target: Checkpoint, draft: Checkpoint) -> None:
    """A draft model proposes the target's tokens: the same tokenizer, a language model."""
    from tformer.registry import get_family

    family = get_family(draft.cfg.family)
    if family.generate is None:
        raise TformerError(f"--draft {draft.label} is a {family.name} model; a draft is a "
                           f"language model")
    if draft.tokenizer.to_json() != target.tokenizer.to_json():
        raise TformerError(
            f"--draft {draft.label}: its tokenizer is not {target.label}'s (vocabulary "
            f"{draft.tokenizer.vocab_size:,} against {target.tokenizer.vocab_size:,}); a "
            f"draft must share the target's tokenizer"
        )


def load(
    path: str | Path,
    *,
    weights: str | None = None,
    device: str = "auto",
    threads: int | None = None,
    needs: str | None = None,
    ensemble: Sequence[str] = (),
) -> Model:
    """Load a run (its best checkpoint, else its newest) or one checkpoint directory.

    weights: the linear layers' weight format (kernels/formats.py: "fp32", prepacked for
        decoding's small products, "int8", the block formats "q8_0" ... "q6_k", the
        mixtures "q4_k_m", "q5_k_m", CPU); None keeps the
        checkpoint's own (the blocks it holds as they are, fp32 for the rest).
    threads: torch's CPU threads (default: one per core nothing else is using).
    needs: "generate" or "translate": a checkpoint of a family that cannot is a clear error.
    ensemble: translation checkpoints to decode together with this one (the mean of their
    next-token distributions); they must share its tokenizer.
    """
    import torch

    from tformer.kernels.blocks import format_names, formats_of, held_weights
    from tformer.kernels.formats import quantize_model
    from tformer.loading import load_checkpoint
    from tformer.registry import families_with, get_family
    from tformer.training.device import decoding_threads, pick_device

    dev = pick_device(device)
    loaded = load_checkpoint(path, device=dev, weights=weights)
    family = get_family(loaded.cfg.family)
    if needs == "generate" and family.generate is None:
        hint = "; use `tformer translate`" if family.translate is not None else ""
        raise TformerError(
            f"checkpoint {loaded.label} is a {family.name} model; generate needs a language "
            f"model ({' or '.join(families_with('generate'))}){hint}"
        )
    if needs == "translate" and family.translate is None:
        raise TformerError(
            f"checkpoint {loaded.label} is a {family.name} model; translate needs a "
            f"sequence-to-sequence model ({' or '.join(families_with('translate'))}); use "
            f"`tformer generate` for language models"
        )
    if ensemble:
        join_ensemble(loaded, list(ensemble), dev)
    threads = decoding_threads(threads)
    torch.set_num_threads(threads)
    # Counted before a weight format turns the weights into buffers (and those the
    # checkpoint holds as blocks, counted as the values they hold).
    parameters = sum(p.numel() for p in loaded.model.parameters()) + held_weights(loaded.model)
    loaded.model = quantize_model(loaded.model, weights)
    held = sorted({name for fmt in formats_of(loaded.model).values()
                   for name in format_names(fmt)})
    weights = weights or ("+".join(held) if held else "fp32")
    return Model(loaded, family, weights=weights, threads=threads, parameters=parameters)


def join_ensemble(loaded: Checkpoint, others: list[str], device: Any) -> None:
    """Make `loaded` decode together with the checkpoints `others`, as one ensemble
    (tformer.decoding.ensemble). They must be translation models with the same tokenizer;
    `loaded` gives the run's settings."""
    from tformer.decoding.ensemble import Ensemble
    from tformer.loading import load_checkpoint
    from tformer.registry import get_family

    if get_family(loaded.cfg.family).translate is None:
        raise TformerError(f"--ensemble needs translation models; {loaded.label} is a "
                           f"{loaded.cfg.family} model")
    members = [loaded.model]
    for path in others:
        other = load_checkpoint(path, device=device, family=loaded.cfg.family)
        if other.tokenizer.to_json() != loaded.tokenizer.to_json():
            raise TformerError(f"--ensemble {path}: its tokenizer is not {loaded.label}'s; the "
                               f"models of an ensemble must share one")
        members.append(other.model)
    loaded.model = Ensemble(members)


class Model:
    """A loaded checkpoint, ready to decode. `checkpoint` is what was loaded (its `model` the
    module as decoding runs it), `family` its registry entry."""

    def __init__(
        self, checkpoint: Checkpoint, family: Family, *, weights: str, threads: int,
        parameters: int,
    ) -> None:
        self.checkpoint = checkpoint
        self.family = family
        self.weights = weights
        self.threads = threads
        self.parameters = parameters

    @property
    def module(self) -> nn.Module:
        return self.checkpoint.model

    @property
    def tokenizer(self) -> Any:
        return self.checkpoint.tokenizer

    @property
    def name(self) -> str:
        return self.checkpoint.name

    @property
    def label(self) -> str:
        return self.checkpoint.label

    @property
    def device(self) -> torch.device:
        """Where the weights are (those of a format other than fp32 are buffers)."""
        for tensor in itertools.chain(self.module.parameters(), self.module.buffers()):
            return tensor.device
        raise TformerError(f"{self.label} holds no weights")

    @property
    def description(self) -> str:
        """"0.5M parameters, int8; cpu, 2 threads": for start-up lines."""
        n = self.parameters
        size = f"{n / 1e6:.1f}M parameters" if n >= 1e5 else f"{n:,} parameters"
        where = str(self.device)
        if self.device.type == "cpu":
            where = f"cpu, {self.threads} thread{'s' if self.threads != 1 else ''}"
        return f"{size}{'' if self.weights == 'fp32' else ', ' + self.weights}; {where}"

    @property
    def window(self) -> int | None:
        """The most prompt tokens generation reads (a longer prompt loses its start)."""
        return self.family.window(self.module)

    def generator(self, seed: int) -> torch.Generator:
        import torch

        return torch.Generator(device=self.device).manual_seed(seed)

    def prompt_ids(self, text: str) -> list[int]:
        """The prompt's tokens, after bos where the model reads texts so; an empty prompt
        starts from bos (or a newline)."""
        from tformer.data.tokenizers import prompt_start

        return prompt_start(self.tokenizer, self.tokenizer.encode(text))

    # --- language models ----------------------------------------------------------------

    def stream(
        self,
        prompt: str | list[int],
        *,
        max_new_tokens: int = SAMPLING.max_new_tokens,
        temperature: float = SAMPLING.temperature,
        top_k: int = SAMPLING.top_k,
        top_p: float = SAMPLING.top_p,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        draft: Model | None = None,
        prompt_lookup: int = 0,
        draft_tokens: int = DRAFT_TOKENS,
        stats: SpeculationStats | None = None,
        json_schema: dict[str, Any] | str | None = None,
        regex: str | None = None,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        min_tokens: int = 0,
        ignore_eos: bool = False,
    ) -> Iterator[str]:
        """The continuation of `prompt` (text, or token ids), as pieces of text as they are
        decoded; it stops at the model's end-of-text token (any of them, where its tokenizer
        has several).

        json_schema (a schema, or its JSON) or regex: the continuation follows it, every
        token drawn among those that can continue it, and it ends where the text is
        complete (tformer.decoding.constraints; needs the `structured` extra).

        draft (a model of the same tokenizer) or prompt_lookup (an n-gram size): speculative
        decoding, draft_tokens at a time (tformer.decoding.speculative): the same
        distribution, the same greedy text, fewer passes of this model; `stats` counts
        what the drafts bought.

        min_p, repetition_penalty, min_tokens, ignore_eos: as vLLM's
        (tformer.decoding.sampling.ExtraSampling), for models decoded with a KV cache,
        without speculation."""
        if self.family.generate is None:
            raise TformerError(f"{self.label} is a {self.family.name} model; it does not "
                               f"generate text")
        check_generation_args(max_new_tokens, temperature, top_k, top_p)
        ids = self.prompt_ids(prompt) if isinstance(prompt, str) else list(prompt)
        constraint = self._constraint(json_schema, regex)
        if constraint is not None and (draft is not None or prompt_lookup):
            raise TformerError("a JSON schema or regex decodes without speculation: drop "
                               "the draft or the prompt lookup")
        from tformer.decoding.sampling import ExtraSampling

        extra = self._extra(ExtraSampling(min_p, repetition_penalty, min_tokens, ignore_eos),
                            speculative=draft is not None or bool(prompt_lookup))
        new: list[int] = []
        shown = ""
        for tokens in self._tokens(ids, max_new_tokens, temperature, top_k, top_p, generator,
                                   use_cache, draft, prompt_lookup, draft_tokens, stats,
                                   constraint, extra):
            new += tokens
            text = self.tokenizer.decode(new)
            # A byte-level token may end inside a character: wait for the rest of it.
            if not text.endswith("\ufffd"):
                yield text[len(shown):]
                shown = text
        rest = self.tokenizer.decode(new)[len(shown):]
        if rest:
            yield rest

    def _tokens(
        self, ids: list[int], max_new_tokens: int, temperature: float, top_k: int,
        top_p: float, generator: torch.Generator | None, use_cache: bool,
        draft: Model | None, prompt_lookup: int, draft_tokens: int,
        stats: SpeculationStats | None, constraint: Matcher | None = None,
        extra: ExtraSampling | None = None,
    ) -> Iterator[list[int]]:
        """The new tokens, a step (or a speculative round) at a time."""
        import torch

        if draft is None and not prompt_lookup:
            more: dict[str, Any] = {} if constraint is None else {"constraint": constraint}
            if extra is not None:
                more["extra"] = extra
            for token in self.family.generate(
                self.module, torch.tensor([ids], device=self.device),
                max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                top_p=top_p, generator=generator, use_cache=use_cache,
                eos_id=self.tokenizer.eos_ids, **more,
            ):
                if stats is not None:
                    stats.tokens += 1
                    stats.rounds += 1
                yield [int(token[0])]
            return
        from tformer.decoding.speculative import speculative_generate

        if draft is not None:
            self.check_draft(draft)
        for new in speculative_generate(
            self.module, [ids], max_new_tokens=max_new_tokens,
            draft=draft.module if draft is not None else None, lookup=prompt_lookup,
            draft_tokens=draft_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            generator=generator, eos_id=self.tokenizer.eos_ids, stats=stats,
        ):
            yield new[0]

    def _constraint(self, json_schema: dict[str, Any] | str | None, regex: str | None
                    ) -> Matcher | None:
        """A fresh matcher of the schema or regex (compiled once per model and text)."""
        from tformer.decoding import constraints, lm

        if json_schema is None and regex is None:
            return None
        if json_schema is not None and regex is not None:
            raise TformerError("give a JSON schema or a regex, not both")
        if self.family.generate is not lm.generate:
            raise TformerError(f"{self.label} is a {self.family.name} model; a JSON schema or "
                               f"regex constrains models decoded with a KV cache")
        spec = (constraints.Constraint.json_schema(json_schema) if json_schema is not None
                else constraints.Constraint.regex(regex or ""))
        V = self.module.cfg.vocab_size
        return constraints.compile_grammar(self.tokenizer, spec, V).start()

    def _extra(self, extra: ExtraSampling, *, speculative: bool) -> ExtraSampling | None:
        """The settings beyond temperature, top-k and top-p, where this model's decoding
        takes them (None: none asked)."""
        from tformer.decoding import lm
        from tformer.decoding.sampling import NO_EXTRA

        if extra == NO_EXTRA:
            return None
        if self.family.generate is not lm.generate:
            raise TformerError(f"{self.label} is a {self.family.name} model; min_p, "
                               f"repetition_penalty, min_tokens and ignore_eos are for models "
                               f"decoded with a KV cache")
        if speculative:
            raise TformerError("min_p, repetition_penalty, min_tokens and ignore_eos decode "
                               "without speculation: drop the draft or the prompt lookup")
        return extra

    def check_draft(self, draft: Model) -> None:
        """A draft model proposes this model's tokens: the same tokenizer, a language model."""
        check_draft(self.checkpoint, draft.checkpoint)

    def generate(
        self,
        prompt: str = "",
        *,
        max_new_tokens: int = SAMPLING.max_new_tokens,
        temperature: float = SAMPLING.temperature,
        top_k: int = SAMPLING.top_k,
        top_p: float = SAMPLING.top_p,
        seed: int = SAMPLING.seed,
        use_cache: bool = True,
        draft: Model | None = None,
        prompt_lookup: int = 0,
        draft_tokens: int = DRAFT_TOKENS,
        json_schema: dict[str, Any] | str | None = None,
        regex: str | None = None,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        min_tokens: int = 0,
        ignore_eos: bool = False,
    ) -> str:
        """The continuation of `prompt` (the prompt itself not included). temperature 0 is
        greedy; the same seed gives the same text as `tformer generate --seed`. draft,
        prompt_lookup, draft_tokens: speculative decoding; json_schema, regex: the text
        follows them; min_p, repetition_penalty, min_tokens, ignore_eos: vLLM's; as in
        `stream`."""
        return "".join(self.stream(
            prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
            top_p=top_p, generator=self.generator(seed), use_cache=use_cache, draft=draft,
            prompt_lookup=prompt_lookup, draft_tokens=draft_tokens, json_schema=json_schema,
            regex=regex, min_p=min_p, repetition_penalty=repetition_penalty,
            min_tokens=min_tokens, ignore_eos=ignore_eos,
        ))

    def score(self, text: str) -> list[tuple[str, float]]:
        """Each token of `text` after the first (every one, where the model reads a text
        after bos), with its log-probability (natural log) given the tokens before it. A
        text longer than the model's context is read in consecutive windows of the context,
        as `tformer evaluate` reads a file."""
        import torch

        from tformer.data.tokenizers import text_start

        if self.family.generate is None:
            raise TformerError(f"{self.label} is a {self.family.name} model; score needs a "
                               f"language model")
        ids = text_start(self.tokenizer, self.tokenizer.encode(text))
        if len(ids) < 2:
            raise TformerError("score needs a text of at least two tokens")
        window = self.window or len(ids)
        logprobs: list[float] = []
        with torch.no_grad():
            for start in range(0, len(ids) - 1, window):
                chunk = torch.tensor([ids[start : start + window + 1]], device=self.device)
                logits = self.module(chunk[:, :-1])[0].float().log_softmax(-1)
                logprobs += logits.gather(1, chunk[0, 1:, None])[:, 0].tolist()
        pairs = zip(ids[1:], logprobs, strict=True)
        return [(self.tokenizer.decode([t]), lp) for t, lp in pairs]

    def embed(self, texts: str | Sequence[str], *, pooling: str = "mean") -> torch.Tensor:
        """Each text's embedding, (len(texts), D) float32, each of unit length (so that a dot
        product is the cosine similarity): the last block's states pooled, "mean" over the
        text's tokens (the default) or its "last" token's (tformer.decoding.embeddings).
        The same vectors as `tformer serve`'s /v1/embeddings and /api/embed."""
        from tformer.data.tokenizers import text_start
        from tformer.decoding.embeddings import check_embedder, check_pooling, embed_ids

        check_embedder(self.module)
        check_pooling(pooling)
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not texts or any(not t for t in texts):
            raise TformerError("embed needs one or more non-empty texts")
        ids = [text_start(self.tokenizer, self.tokenizer.encode(t)) for t in texts]
        return embed_ids(self.module, ids, pooling=pooling)

    # --- translation --------------------------------------------------------------------

    def translate(
        self,
        lines: str | Sequence[str],
        *,
        beam: int = 4,
        alpha: float = 0.6,
        length_penalty: str = "gnmt",
        max_len_a: float | None = None,
        max_len_b: int = 10,
        batch_size: int = 32,
    ) -> str | list[str]:
        """The best translation of each line (of one line: a string). max_len_a None: as
        long, relative to its source, as the training pairs were."""
        if self.family.translate is None:
            raise TformerError(f"{self.label} is a {self.family.name} model; translate needs "
                               f"a sequence-to-sequence model")
        one = isinstance(lines, str)
        results = self.family.translate(
            self.checkpoint, [lines] if one else list(lines), beam=beam, alpha=alpha,
            max_len_a=max_len_a, max_len_b=max_len_b, n_best=1, early_stopping=False,
            batch_size=batch_size, progress=None, length_penalty=length_penalty,
        )
        texts = [hyps[0].text for hyps in results]
        return texts[0] if one else texts
