"""`tformer serve CKPT`: load a checkpoint and serve it over HTTP until SIGINT or SIGTERM,
which let the requests in flight finish first; the exit status is then 0.

Its options are serve_command's parameters (tformer.arguments); the CLI imports this module to
build its parser, so its own imports stay light (no torch, fastapi or uvicorn at the top)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from tformer.api import (
    DRAFT_TOKENS,
    Draft,
    DraftTokens,
    PromptLookup,
    Weights,
    check_speculation_args,
)
from tformer.arguments import Help
from tformer.errors import TformerError

if TYPE_CHECKING:
    from tformer.loading import Checkpoint
    from tformer.serving.speculation import Speculator

log = logging.getLogger(__name__)

def require_serving_packages() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise TformerError(
            f"serving needs {e.name}, which is not installed: pip install 'tformer[serve]'"
        ) from None


def serve_command(
    checkpoint: Annotated[str, Help("run or checkpoint directory")],
    *,
    host: Annotated[str, Help("address to bind (default: loopback)")] = "127.0.0.1",
    port: Annotated[int, Help("port to listen on")] = 8000,
    api_key: Annotated[str | None, Help("require 'Authorization: Bearer KEY'")] = None,
    weights: Weights = None,
    device: Annotated[str, Help("auto (CUDA if present) | cpu | cuda:N")] = "auto",
    name: Annotated[str | None, Help("the model's name in the API (default: the run)")] = None,
    max_batch: Annotated[int, Help("sequences decoded together")] = 16,
    max_waiting: Annotated[
        int, Help("sequences queued; past it requests get 503 with Retry-After")
    ] = 64,
    max_body_bytes: Annotated[int, Help("the largest request body accepted")] = 1 << 20,
    batch_window_ms: Annotated[
        float, Help("an idle server waits this long for translations arriving together, "
                    "to start them in one step (later ones join the next step)")
    ] = 10.0,
    chat_template: Annotated[
        str | None, Help("a Jinja chat template for /v1/chat/completions (default: the "
                         "checkpoint's chat_template.jinja)", metavar="FILE")
    ] = None,
    draft: Draft = None,
    draft_tokens: DraftTokens = DRAFT_TOKENS,
    prompt_lookup: PromptLookup = 0,
    kv_memory: Annotated[
        float | None, Help("GiB for the KV cache's blocks; a request that does not fit "
                           "waits (default: half the memory free at start, at most what "
                           "--max-batch full contexts take)", metavar="GIB")
    ] = None,
    no_prefix_cache: Annotated[
        bool, Help("read every prompt whole, even where the KV pool holds its start")
    ] = False,
    step_tokens: Annotated[
        int, Help("tokens a decoding step reads at most: long prompts are read in chunks "
                  "of it between the running sequences' steps")
    ] = 512,
    # The names of tformer.decoding.embeddings.POOLINGS, written here so that parsing the
    # command line imports no torch (tests/serving/test_apis.py checks they agree).
    pooling: Annotated[
        str, Help("how /v1/embeddings and /api/embed pool a text's states: %(choices)s",
                  choices=("mean", "last"))
    ] = "mean",
) -> int:
    require_serving_packages()
    import uvicorn

    from tformer.data.chat import load_chat_template, special_tokens
    from tformer.kernels.formats import quantize_model
    from tformer.loading import load_checkpoint
    from tformer.registry import get_family
    from tformer.serving.app import create_app
    from tformer.serving.protocol import Limits
    from tformer.serving.scheduler import LMEngine
    from tformer.serving.translation import TranslationEngine
    from tformer.training.device import pick_device

    if not 1 <= port <= 65535:
        raise TformerError(f"--port {port} must be between 1 and 65535")
    if max_batch < 1 or max_waiting < 1:
        raise TformerError(f"--max-batch {max_batch} and --max-waiting {max_waiting} must be "
                           f"at least 1")
    if max_body_bytes < 1024:
        raise TformerError(f"--max-body-bytes {max_body_bytes} must be at least 1024")
    if batch_window_ms < 0:
        raise TformerError(f"--batch-window-ms {batch_window_ms} must be 0 or more")
    if kv_memory is not None and kv_memory <= 0:
        raise TformerError(f"--kv-memory {kv_memory} must be more than 0 GiB")
    if step_tokens < 1:
        raise TformerError(f"--step-tokens {step_tokens} must be at least 1")
    if api_key is not None and not api_key:
        raise TformerError("--api-key must not be empty")
    check_speculation_args(draft, draft_tokens, prompt_lookup)

    where = pick_device(device)
    loaded = load_checkpoint(checkpoint, device=where, weights=weights)
    family = get_family(loaded.cfg.family)
    if family.generate is None and family.translate is None:
        raise TformerError(f"the {family.name} family neither generates nor translates")
    kind = "lm" if family.generate is not None else "seq2seq"
    model = quantize_model(loaded.model, weights)
    tokenizer = loaded.tokenizer
    name = name or loaded.name
    if kind == "lm":
        # A model that offers a KV cache (tformer.decoding.lm's protocol) decodes by
        # continuous batching; one whose memory is its cache decodes one sequence per slot.
        batched = callable(getattr(model, "make_cache", None))
        speculator = speculator_for(loaded, model, draft=draft, draft_tokens=draft_tokens,
                                    prompt_lookup=prompt_lookup, weights=weights,
                                    device=where, capacity=max_batch)
        blocks = kv_blocks(model, kv_memory, max_batch, where) if batched else None
        engine: LMEngine | TranslationEngine = LMEngine(
            model, eos_id=tokenizer.eos_ids, max_batch=max_batch, max_waiting=max_waiting,
            batched=batched, generate=family.generate, speculator=speculator,
            kv_blocks=blocks, step_tokens=step_tokens, prefix_cache=not no_prefix_cache)
    else:
        if draft is not None or prompt_lookup:
            raise TformerError(f"speculative decoding is for language models; "
                               f"{loaded.label} is a {family.name} model")
        sentences = max(max_batch, 32)
        engine = TranslationEngine(model, tokenizer, window=batch_window_ms / 1000,
                                   batch_size=sentences, max_waiting=max_waiting,
                                   blocks=kv_blocks(model, kv_memory, sentences, where))
    specials = special_tokens(tokenizer)
    template = load_chat_template(loaded.path, chat_template, specials) if kind == "lm" else None
    app = create_app(engine, tokenizer, model_name=name, kind=kind, api_key=api_key,
                     limits=Limits(max_body_bytes=max_body_bytes),
                     created=created_time(loaded.path), chat_template=template,
                     pooling=pooling)
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        log.warning("serving on %s without --api-key: anyone who can reach it may use it", host)
    how = ""
    pool = getattr(engine, "slots", None)  # a KV-cache model's paged pool
    if pool is not None:
        how = (f"; KV pool {pool.total * pool.block_bytes(model) / 2**30:.2f} GiB "
               f"({pool.total} blocks of {pool.block_size} positions)")
    if draft is not None or prompt_lookup:
        how += (f"; {'prompt lookup' if prompt_lookup else draft} drafts {draft_tokens} "
               f"tokens a round")
    print(f"tformer: serving {name} ({loaded.cfg.family}) at http://{host}:{port}{how}",
          file=sys.stderr, flush=True)
    # Keep idle connections longer than clients do (httpx and many others drop theirs after
    # 5 s, uvicorn's default too): else a client may send a request on a connection the
    # server is closing at that moment, and get a read error.
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=None, timeout_keep_alive=15)
    server = draining_server_class()(config)
    server.run()
    if server.signalled is not None:
        log.info("stopped by %s after the requests in flight finished",
                 signal.Signals(server.signalled).name)
    return 0


def free_memory(device: Any) -> int:
    """Bytes free on `device` now: the accelerator's, or the machine's available memory."""
    import torch

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_blocks(model: Any, gib: float | None, max_batch: int, device: Any) -> int:
    """Blocks of the paged KV pool: `gib` GiB of them, or half the free memory, at most
    what max_batch full contexts take (a translation model's: what max_batch sentences
    take, serving/translation.py's default_blocks)."""
    from tformer.decoding.paged import PagedPool, blocks_for
    from tformer.serving.translation import default_blocks

    size = PagedPool.block_bytes(model)
    context = getattr(model.cfg, "context", None)
    most = (max_batch * blocks_for(context) + 1 if context is not None
            else default_blocks(model, max_batch))
    if gib is None:
        return max(2, min(most, free_memory(device) // 2 // size))
    blocks = int(gib * 2**30 // size)
    if blocks < 2:
        raise TformerError(f"--kv-memory {gib} GiB holds no block of the KV cache "
                           f"({size / 2**20:.2f} MiB each)")
    return blocks


def speculator_for(loaded: Checkpoint, model: Any, *, draft: str | None, draft_tokens: int,
                   prompt_lookup: int, weights: str | None, device: Any, capacity: int
                   ) -> Speculator | None:
    """What drafts for the engine (--draft, --prompt-lookup), checked; None without either."""
    if draft is None and not prompt_lookup:
        return None
    from tformer.api import check_draft
    from tformer.kernels.formats import quantize_model
    from tformer.loading import load_checkpoint
    from tformer.serving.speculation import Speculator

    def check_cache(module: Any, checkpoint: Checkpoint) -> None:
        if not callable(getattr(module, "make_cache", None)):
            raise TformerError(f"speculative decoding needs models with a KV cache (gpt); "
                               f"{checkpoint.label} is a {checkpoint.cfg.family} model")

    check_cache(model, loaded)
    drafter = None
    if draft is not None:
        other = load_checkpoint(draft, device=device, weights=weights)
        check_draft(loaded, other)
        drafter = quantize_model(other.model, weights)
        check_cache(drafter, other)
    return Speculator(capacity=capacity, draft=drafter, lookup=prompt_lookup,
                      draft_tokens=draft_tokens)


def draining_server_class() -> type:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, except that a SIGINT or SIGTERM it has drained on is not raised
        again afterwards (uvicorn re-raises it, so the process would die by the signal, exit
        status -15, after a clean shutdown)."""

        signalled: int | None = None

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            def handle(sig: int, frame: object) -> None:
                self.signalled = sig
                self.handle_exit(sig, frame)
            handled = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, handle) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return DrainingServer


def created_time(checkpoint: Path) -> int:
    """When the checkpoint was written, as a Unix time (its config's modification time)."""
    try:
        return int((Path(checkpoint) / "config.json").stat().st_mtime)
    except OSError:
        return int(time.time())
