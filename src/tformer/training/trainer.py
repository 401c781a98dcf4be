"""The training loop, the same for every family.

Read `train` top to bottom: set-up (or restore), then one loop of optimizer steps with
evaluation and checkpoints at fixed intervals. Everything family-specific is behind the task
(see tformer.tasks): its batches, its loss, its validation metrics.
"""

from __future__ import annotations

import csv
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model
from torch import nn

from tformer.config import RunConfig, TrainConfig
from tformer.data.tokenizers import load_tokenizer
from tformer.errors import TformerError
from tformer.registry import get_family
from tformer.training import checkpoint as ckpt
from tformer.training import distributed
from tformer.training.device import autocast
from tformer.training.schedule import learning_rate

log = logging.getLogger(__name__)

METRICS = "metrics.csv"
METRIC_FIELDS = ("step", "split", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s")

Progress = Callable[[dict[str, Any]], None]


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    val_loss: float | None
    best_val_loss: float | None
    skipped_steps: int
    interrupted: bool


def make_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only (not biases or norms).

    The fused implementation (one kernel over all parameters) on CPU as on GPUs: on CPU it
    updates a 0.8M-parameter model in a sixth of the time of the default per-op one, a tenth
    of a small model's training step (benchmarks/speed.py).
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type in ("cpu", "cuda")
    )


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class MetricsLog:
    """metrics.csv in the run directory, one row per logged step or evaluation."""

    def __init__(self, run_dir: Path, resume_step: int | None) -> None:
        self.path = run_dir / METRICS
        if resume_step is not None and self.path.exists():
            # Rows written after the checkpoint we resume from are about to be redone; a row
            # cut short by a kill is dropped.
            with open(self.path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if self._complete(r, resume_step)]
            self._write(rows, "w")
        elif not self.path.exists() or resume_step is None:
            self._write([], "w")

    def _write(self, rows: list[dict[str, Any]], mode: str) -> None:
        with open(self.path, mode, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=METRIC_FIELDS)
            if mode == "w":
                writer.writeheader()
            writer.writerows(rows)

    @staticmethod
    def _complete(row: dict[str, Any], last_step: int) -> bool:
        if None in row.values() or None in row or not row["step"].isdigit():
            return False
        return int(row["step"]) <= last_step and row["split"] in ("train", "val")

    def add(self, **row: Any) -> None:
        self._write([row], "a")


@contextmanager
def stop_requests() -> Iterator[threading.Event]:
    """An event set by Ctrl-C or SIGTERM, so the loop can save and stop between steps."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def request_stop(signum: int, frame: Any) -> None:
        log.warning("got %s: saving a checkpoint and stopping", signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def train(
    cfg: RunConfig,
    run_dir: str | Path,
    *,
    resume_from: Path | None = None,
    progress: Progress | None = None,
) -> TrainResult:
    """Train a model as `cfg` says, writing checkpoints and metrics into `run_dir`.

    resume_from: a checkpoint of this run to continue from, exactly where it stopped
        (`checkpoint.resume_point(run_dir)` finds the newest good one).
    progress: called with a dict after logged steps and evaluations (the CLI's progress bar).

    Under torchrun every process calls this; rank 0 alone logs, evaluates and saves.
    """
    run_dir = Path(run_dir)
    tcfg = cfg.train
    family = get_family(cfg.family)
    procs, device = distributed.setup(tcfg.device)
    main = procs.is_main

    # --- set-up: data, model, optimizer, or all of them restored from a checkpoint -------
    tokenizer = None
    state: dict[str, Any] | None = None
    if resume_from is not None:
        tokenizer = load_tokenizer(resume_from / ckpt.TOKENIZER)
        state = ckpt.load_trainer_state(resume_from)
    torch.manual_seed(tcfg.seed)
    task = family.task(cfg, tokenizer)
    cfg = cfg.replace("model", **task.model_fields())
    model = family.model(cfg.model).to(device)
    if state is not None:
        load_model(model, str(resume_from / ckpt.WEIGHTS), device=str(device))
    # Dropout differs between ranks, as it would between the rows of one large batch.
    torch.manual_seed(tcfg.seed + procs.rank)
    train_model = distributed.wrap(model, procs, device, tcfg.parallel)
    if tcfg.compile:
        train_model = torch.compile(train_model)
    optimizer = make_optimizer(model, tcfg, device)
    batches = task.train_batches(tcfg.seed)

    step, best_val, skipped = 0, None, 0
    if state is not None:
        distributed.load_optimizer_state(model, optimizer, state["optimizer"], procs, tcfg.parallel)
        same_layout = len(state["data_per_rank"]) == procs.world_size
        batches.load_state_dict(state["data_per_rank"][procs.rank if same_layout else 0])
        if same_layout:
            set_rng_state(state["rng_per_rank"][procs.rank])
        step, best_val, skipped = state["step"], state["best_val_loss"], state["skipped_steps"]
        log.info("resuming %s at step %d", run_dir, step)
    if main and progress:
        # The summary is optional in a task: a family without it still trains.
        described = getattr(task, "summary", dict)()
        progress({"step": step, "start": {
            "parameters": sum(p.numel() for p in model.parameters()),
            "device": str(device), "threads": torch.get_num_threads(),
            "processes": procs.world_size, "vocabulary": task.tokenizer.vocab_size,
            **described,
        }})
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.write_json(run_dir / ckpt.CONFIG, cfg.to_dict())
        metrics = MetricsLog(run_dir, step if state is not None else None)

    def save(path: Path) -> None:
        """Every rank takes part (FSDP gathers its shards); rank 0 writes."""
        weights = distributed.full_state_dict(model, procs, tcfg.parallel)
        optimizer_state = distributed.optimizer_state(model, optimizer, procs, tcfg.parallel)
        data_states = distributed.gather_objects(batches.state_dict(), procs)
        rng_states = distributed.gather_objects(rng_state(), procs)
        if main:
            trainer_state = {
                "step": step,
                "optimizer": optimizer_state,
                "data_per_rank": data_states,
                "rng_per_rank": rng_states,
                "best_val_loss": best_val,
                "skipped_steps": skipped,
            }
            to_save = model
            if weights is not None:
                to_save = family.model(cfg.model)
                to_save.load_state_dict(weights)
            ckpt.save_checkpoint(path, cfg, to_save, task.tokenizer, trainer_state)
        distributed.barrier(procs)

    def evaluate() -> float:
        nonlocal best_val
        val = torch.zeros((), device=device)
        if main or tcfg.parallel == "fsdp":  # FSDP's shards all take part in each forward
            result = task.evaluate(model, max_batches=tcfg.eval_batches)
            val += result["loss"]
        val = float(distributed.broadcast_from_main(val, procs))
        improved = best_val is None or val < best_val
        if main:
            metrics.add(step=step, split="val", loss=f"{val:.6f}")
            if progress:
                progress({"step": step, "val": result})
        if improved:
            best_val = val
            save(run_dir / ckpt.BEST)
        return val

    # --- the loop ------------------------------------------------------------------------
    # Each micro-batch adds the gradient of its summed token losses; the sum over ranks and
    # micro-batches is then divided by the global token count, so every token weighs the
    # same whatever the number of processes or the split into micro-batches.
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    interrupted, val_loss, bad_in_a_row = False, None, 0
    tokens_since, time_since, started = 0, time.perf_counter(), time.perf_counter()
    # The logged training loss is the token-weighted mean over the steps since the last
    # log, not one batch's (which swings widely with token-count batches).
    logged_loss, logged_tokens = 0.0, 0.0
    with stop_requests() as stop:
        while step < tcfg.steps:
            lr = learning_rate(step, tcfg, getattr(cfg.model, "d_model", 512))
            for group in optimizer.param_groups:
                group["lr"] = lr

            totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss, tokens, stop
            for micro in range(tcfg.accumulate):
                batch = distributed.shard(next(batches), procs).to(device)
                last = micro == tcfg.accumulate - 1
                with distributed.no_sync(train_model, skip=not last):
                    with autocast(device, tcfg.precision):
                        loss, n_tokens = task.loss(train_model, batch)
                    (loss * n_tokens).backward()
                totals[0] += loss.detach().double() * n_tokens
                totals[1] += n_tokens
            totals[2] = float(stop.is_set())
            loss_sum, global_tokens, stop_votes = distributed.sum_over_ranks(totals, procs).tolist()
            tokens_since += int(global_tokens)
            for p in params:
                if p.grad is not None:
                    # DDP averaged over ranks: scale the mean of sums to the global token mean.
                    p.grad.mul_(procs.world_size / max(global_tokens, 1.0))
            max_norm = tcfg.grad_clip if tcfg.grad_clip > 0 else math.inf
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            loss_value = loss_sum / max(global_tokens, 1.0)
            if math.isfinite(loss_value):
                logged_loss, logged_tokens = logged_loss + loss_sum, logged_tokens + global_tokens

            if math.isfinite(loss_value) and math.isfinite(grad_norm):
                optimizer.step()
                bad_in_a_row = 0
            else:
                skipped += 1
                bad_in_a_row += 1
                log.warning("step %d: non-finite loss or gradient, step skipped", step + 1)
                if bad_in_a_row >= tcfg.max_bad_steps:
                    raise TformerError(
                        f"training stopped at step {step + 1}: {bad_in_a_row} steps in a row had "
                        f"a non-finite loss or gradient (try a lower train.lr); the checkpoints "
                        f"in {run_dir} are from before"
                    )
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if main and (step % tcfg.log_every == 0 or step == tcfg.steps):
                elapsed = time.perf_counter() - time_since
                mean_loss = logged_loss / logged_tokens if logged_tokens else math.nan
                metrics.add(
                    step=step,
                    split="train",
                    loss=f"{mean_loss:.6f}",
                    lr=f"{lr:.6g}",
                    grad_norm=f"{grad_norm:.4f}",
                    tokens_per_s=f"{tokens_since / elapsed:.1f}",
                    elapsed_s=f"{time.perf_counter() - started:.1f}",
                )
                if progress:
                    progress(
                        {
                            "step": step,
                            "loss": mean_loss,
                            "lr": lr,
                            "tokens_per_s": tokens_since / elapsed,
                        }
                    )
                tokens_since, time_since = 0, time.perf_counter()
                logged_loss, logged_tokens = 0.0, 0.0
            if step % tcfg.eval_every == 0 or step == tcfg.steps:
                val_loss = evaluate()
                model.train()
                time_since = time.perf_counter()
            if stop_votes > 0:  # every rank stops at the same step
                interrupted = True
                break
            if step % tcfg.checkpoint_every == 0 or step == tcfg.steps:
                save(ckpt.step_dir(run_dir, step))
                if main:
                    ckpt.prune_checkpoints(run_dir, tcfg.keep_checkpoints)
                time_since = time.perf_counter()
        if interrupted:
            save(ckpt.step_dir(run_dir, step))
            if main:
                ckpt.prune_checkpoints(run_dir, tcfg.keep_checkpoints)
    del train_model  # DDP's reducer holds the process group: it goes before the group
    distributed.teardown()
    return TrainResult(run_dir, step, val_loss, best_val, skipped, interrupted)
