"""The training loop, the same for every family.

Read `train` top to bottom: set-up (or restore), then one loop of optimizer steps with
evaluation and checkpoints at fixed intervals. Everything family-specific is behind the task
(see tformer.tasks): its batches, its loss, its validation metrics.
"""

from __future__ import annotations

import dataclasses
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
from torch import nn

from tformer import loading
from tformer.config import HIGHER_IS_BETTER, RunConfig
from tformer.data.tokenizers import load_tokenizer
from tformer.errors import TformerError
from tformer.evaluation.shard import Shard
from tformer.registry import Family, get_family
from tformer.training import checkpoint as ckpt
from tformer.training import distributed, lora
from tformer.training.device import autocast
from tformer.training.metrics import MetricsLog
from tformer.training.optimizer import make_optimizer
from tformer.training.schedule import Horizon, extend, learning_rate

log = logging.getLogger(__name__)

Progress = Callable[[dict[str, Any]], None]


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    val_loss: float | None
    best_val: float | None
    """The best validation value of train.best_metric."""
    skipped_steps: int
    interrupted: bool
    stopped_early: bool = False
    """train.patience evaluations passed without a better train.best_metric."""
    stop_signal: int | None = None
    """The signal (SIGINT, SIGTERM) that stopped an interrupted run."""


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class StopRequest(threading.Event):
    """Set by Ctrl-C or SIGTERM, so the loop can save and stop between steps."""

    signum: int | None = None


@contextmanager
def stop_requests() -> Iterator[StopRequest]:
    """A StopRequest set by Ctrl-C or SIGTERM, which it records."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def request_stop(signum: int, frame: Any) -> None:
        log.warning("got %s: saving a checkpoint and stopping", signal.Signals(signum).name)
        stop.signum = signum
        stop.set()

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@dataclass
class Run:
    """A training run in progress: the live objects, and the counters a checkpoint saves."""

    cfg: RunConfig
    run_dir: Path
    procs: distributed.Processes
    device: torch.device
    family: Family
    task: Any
    model: nn.Module
    train_model: nn.Module
    """What the step runs: the model, or DDP / FSDP / torch.compile around it."""
    optimizer: Any
    """torch.optim.AdamW, or optimizer.MuonWithAdamW (train.optimizer)."""
    batches: Any
    carry: Any
    """What one step hands the next besides the weights (Transformer-XL: its memory)."""
    horizon: Horizon
    metrics: MetricsLog | None
    lora_base: dict[str, str] | None = None
    """A LoRA run's reference to the checkpoint it adapts (loading.base_reference)."""
    window: LogWindow = dataclasses.field(default_factory=lambda: LogWindow())
    """What metrics.csv's next row sums up; saved, so a resumed run writes the same rows."""
    step: int = 0
    best_val: float | None = None
    """The best validation value of train.best_metric so far."""
    skipped_steps: int = 0
    bad_in_a_row: int = 0
    tokens_seen: int = 0
    evals_without_gain: int = 0
    """Evaluations since best_metric last improved (for train.patience)."""

    @property
    def is_main(self) -> bool:
        return self.procs.is_main


@dataclass
class StepResult:
    loss: float
    """Mean loss per target token of the step (over every rank and micro-batch)."""
    tokens: int
    grad_norm: float
    lr: float
    stop_requested: bool


def train(
    cfg: RunConfig,
    run_dir: str | Path,
    *,
    resume_from: Path | None = None,
    progress: Progress | None = None,
) -> TrainResult:
    """Train a model as `cfg` says, writing checkpoints and metrics into `run_dir`.

    resume_from: a checkpoint of this run to continue from, exactly where it stopped
        (`run.resume_point(run_dir)` finds the newest good one).
    progress: called with a dict after logged steps and evaluations (the CLI's progress bar).

    Under torchrun every process calls this; all of them evaluate (each its share of the
    validation data), rank 0 alone logs and writes.
    """
    run = start_run(cfg, Path(run_dir), resume_from)
    if run.is_main and progress:
        progress({"step": run.step, "start": run_summary(run)})
    tcfg = run.cfg.train
    log_window = run.window
    interrupted, stopped_early, val_loss = False, False, None
    run.model.train()
    with stop_requests() as stop:
        while run.step < tcfg.steps:
            result = optimizer_step(run, stop)
            log_window.add(result)
            last = run.step == tcfg.steps
            if run.is_main and (run.step % tcfg.log_every == 0 or last):
                log_training(run, log_window, progress)
            if run.step % tcfg.eval_every == 0 or last:
                val_loss = validate(run, progress)
                log_window.restart_clock()
            if result.stop_requested:  # every rank stops at the same step
                interrupted = True
                break
            if tcfg.patience and run.evals_without_gain >= tcfg.patience:
                log.info("no better validation %s in %d evaluations: stopping",
                         tcfg.best_metric, run.evals_without_gain)
                stopped_early = True
                break
            if run.step % tcfg.checkpoint_every == 0 or last:
                save_step_checkpoint(run)
                log_window.restart_clock()
        if interrupted or stopped_early:
            save_step_checkpoint(run)
    if run.is_main:
        run.metrics.close()
    run.train_model = run.model  # DDP's reducer holds the process group: it goes first
    distributed.teardown()
    return TrainResult(
        run.run_dir, run.step, val_loss, run.best_val, run.skipped_steps, interrupted,
        stopped_early, stop.signum if interrupted else None,
    )


# --- set-up ------------------------------------------------------------------------------


def run_summary(run: Run) -> dict[str, Any]:
    """What is about to train, for the CLI's start-up summary."""
    # The task's own description is optional: a family without one still trains.
    described = getattr(run.task, "summary", dict)()
    return {
        "parameters": lora.parameter_count(run.model),
        "trainable": lora.trainable_parameters(run.model),
        "device": str(run.device), "threads": torch.get_num_threads(),
        "processes": run.procs.world_size, "vocabulary": run.task.tokenizer.vocab_size,
        **described,
    }


def start_run(cfg: RunConfig, run_dir: Path, resume_from: Path | None) -> Run:
    """Data, model, optimizer and counters: new, or restored from `resume_from`."""
    tcfg = cfg.train
    family = get_family(cfg.family)
    if tcfg.best_metric not in family.val_metrics:
        raise TformerError(
            f"train.best_metric = {tcfg.best_metric!r}: the {cfg.family} family measures "
            f"{' | '.join(family.val_metrics)} on its validation split"
        )
    procs, device = distributed.setup(tcfg.device)
    tokenizer, state = None, None
    # Fine-tuning: weights and tokenizer from train.init_from, optimizer and schedule fresh.
    init = None if resume_from is not None else ckpt.initial_weights(tcfg.init_from)
    if resume_from is not None:
        if (resume_from / loading.ADAPTERS).is_file() != (tcfg.lora is not None):
            raise TformerError(
                f"--resume cannot turn train.lora {'on' if tcfg.lora else 'off'}: {resume_from} "
                f"was trained {'without' if tcfg.lora else 'with'} it; start a new run "
                f"(train.init_from={resume_from}) instead"
            )
        tokenizer = load_tokenizer(resume_from / loading.TOKENIZER)
        state = ckpt.load_trainer_state(resume_from)
    elif init is not None:
        tokenizer = load_tokenizer(init / loading.TOKENIZER)
    torch.manual_seed(tcfg.seed)
    task = family.task(cfg, tokenizer)
    if init is None:  # else the model fields are the checkpoint's (config_from_dict)
        cfg = cfg.replace("model", **task.model_fields())
    model = family.model(cfg.model).to(device)
    if state is not None:  # a LoRA run's adapters are restored below, not merged
        loading.load_weights(model, resume_from, adapters=False, device=device)
    elif init is not None:
        loading.load_weights(model, init, device=device)
    base = loading.lora_base(resume_from) if state is not None else init
    if tcfg.lora is not None:
        lora.add_adapters(model, tcfg.lora)
        if state is not None:
            adapters = resume_from / loading.ADAPTERS
            lora.load_adapters(model, lora.read_adapters(adapters), adapters)
    # Dropout differs between ranks, as it would between the rows of one large batch.
    torch.manual_seed(tcfg.seed + procs.rank)
    train_model = distributed.wrap(model, procs, device, tcfg.parallel)
    if tcfg.compile:
        train_model = torch.compile(train_model)
    run = Run(
        cfg=cfg, run_dir=run_dir, procs=procs, device=device, family=family, task=task,
        model=model, train_model=train_model, optimizer=make_optimizer(model, tcfg, device),
        batches=task.train_batches(tcfg.seed), carry=task.new_carry(), horizon=Horizon(tcfg.steps),
        metrics=None,
        lora_base=loading.base_reference(base) if tcfg.lora and base is not None else None,
    )
    if state is not None:
        restore(run, state)
    if run.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.write_json(run_dir / loading.CONFIG, cfg.to_dict())
        run.metrics = MetricsLog(
            run_dir, run.step if state is not None else None, tensorboard=tcfg.tensorboard
        )
    return run


def restore(run: Run, state: dict[str, Any]) -> None:
    """Continue from a trainer state exactly: optimizer, data position, carried state, random
    number generators, counters and the schedule's horizon."""
    procs, tcfg = run.procs, run.cfg.train
    trained_with = state.get("optimizer_name", "adamw")  # older checkpoints: AdamW's
    if trained_with != tcfg.optimizer:
        raise TformerError(
            f"--resume cannot change train.optimizer from {trained_with} to {tcfg.optimizer}: "
            f"the saved optimizer state is {trained_with}'s; start a new run "
            f"(train.init_from={run.run_dir}) instead"
        )
    distributed.load_optimizer_state(
        run.model, run.optimizer, state["optimizer"], procs, tcfg.parallel
    )
    same_layout = len(state["data_per_rank"]) == procs.world_size
    data_state = state["data_per_rank"][procs.rank if same_layout else 0]
    run.batches.load_state_dict(data_state)
    # Older checkpoints kept the carried state inside the data cursor.
    carries = state.get("carry_per_rank") or [d for d in state["data_per_rank"]]
    run.carry = run.task.load_carry(carries[procs.rank if same_layout else 0])
    if same_layout:
        set_rng_state(state["rng_per_rank"][procs.rank])
    run.step, run.skipped_steps = state["step"], state["skipped_steps"]
    run.tokens_seen = state.get("tokens_seen", 0)
    run.window.load_state_dict(state.get("log_window"))
    if state.get("best_metric", "loss") == tcfg.best_metric:
        run.best_val = state.get("best_val", state.get("best_val_loss"))
        run.evals_without_gain = state.get("evals_without_gain", 0)
    elif run.is_main:  # a BLEU is no match for a loss: best/ is chosen afresh
        log.warning("train.best_metric changed from %s to %s: best/ follows %s from now on",
                    state["best_metric"], tcfg.best_metric, tcfg.best_metric)
    saved = state.get("horizon", {"steps": state.get("schedule_steps", tcfg.steps)})
    horizon = Horizon(**saved)
    run.horizon = extend(horizon, run.step, tcfg, schedule_width(run.cfg))
    if run.horizon != horizon and run.is_main:
        log.warning(
            "train.steps changed from %d to %d: the learning rate decays from its current "
            "%.3g to train.min_lr = %.3g at step %d", horizon.steps, tcfg.steps,
            learning_rate(run.step, tcfg, schedule_width(run.cfg), run.horizon), tcfg.min_lr,
            tcfg.steps,
        )
    log.info("resuming %s at step %d", run.run_dir, run.step)


def schedule_width(cfg: RunConfig) -> int:
    """The width that scales the noam schedule (the family's entry says it; the config
    checks that a noam run's family has one)."""
    width = get_family(cfg.family).noam_width
    return width(cfg.model) if cfg.train.schedule == "noam" and width is not None else 0


# --- one optimizer step ------------------------------------------------------------------


def optimizer_step(run: Run, stop: threading.Event) -> StepResult:
    """Forward and backward over `train.accumulate` micro-batches, then one update.

    Each micro-batch adds the gradient of its summed token losses; the sum over ranks and
    micro-batches is then divided by the global token count, so every token weighs the same
    whatever the number of processes or the split into micro-batches. A step whose loss or
    gradient is not finite is skipped whole: no update, and the carried state (Transformer-XL's
    memory) goes back to what it was before the step.
    """
    tcfg, procs = run.cfg.train, run.procs
    lr = learning_rate(run.step, tcfg, schedule_width(run.cfg), run.horizon)
    for group in run.optimizer.param_groups:  # Muon's scaled to train.muon_lr (optimizer.py)
        group["lr"] = lr * group.get("lr_scale", 1.0)

    carry_before, carry = run.carry, run.carry
    totals = torch.zeros(3, dtype=torch.float64, device=run.device)  # loss, tokens, stop
    for micro in range(tcfg.accumulate):
        batch = distributed.shard(next(run.batches), procs).to(run.device)
        with distributed.no_sync(run.train_model, skip=micro < tcfg.accumulate - 1):
            with autocast(run.device, tcfg.precision):
                loss, n_tokens, carry = run.task.loss(run.train_model, batch, carry)
            (loss * n_tokens).backward()
        totals[0] += loss.detach().double() * n_tokens
        totals[1] += n_tokens
    totals[2] = float(stop.is_set())
    loss_sum, global_tokens, stop_votes = distributed.sum_over_ranks(totals, procs).tolist()

    params = [p for p in run.model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is not None:
            # DDP averaged over ranks: scale the mean of sums to the global token mean.
            p.grad.mul_(procs.world_size / max(global_tokens, 1.0))
    max_norm = tcfg.grad_clip if tcfg.grad_clip > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    loss_value = loss_sum / max(global_tokens, 1.0)
    if math.isfinite(loss_value) and math.isfinite(grad_norm):
        run.optimizer.step()
        run.carry, run.bad_in_a_row = carry, 0
    else:
        run.carry = carry_before
        run.skipped_steps += 1
        run.bad_in_a_row += 1
        log.warning("step %d: non-finite loss or gradient, step skipped", run.step + 1)
        if run.bad_in_a_row >= tcfg.max_bad_steps:
            raise TformerError(
                f"training stopped at step {run.step + 1}: {run.bad_in_a_row} steps in a row "
                f"had a non-finite loss or gradient (try a lower train.lr); the checkpoints "
                f"in {run.run_dir} are from before"
            )
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    run.tokens_seen += int(global_tokens)
    return StepResult(loss_value, int(global_tokens), grad_norm, lr, stop_votes > 0)


# --- logging, validation, checkpoints ----------------------------------------------------


class LogWindow:
    """The steps since the last logged row: their token-weighted mean loss (not one batch's,
    which swings widely with token-count batches) and their speed, evaluation and checkpoint
    time left out."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.restart()

    def restart(self) -> None:
        self.loss_sum, self.loss_tokens, self.tokens = 0.0, 0.0, 0
        self.restart_clock()

    def restart_clock(self) -> None:
        self.since = time.perf_counter()

    def add(self, result: StepResult) -> None:
        self.last = result
        self.tokens += result.tokens
        if math.isfinite(result.loss):
            self.loss_sum += result.loss * result.tokens
            self.loss_tokens += result.tokens

    def state_dict(self) -> dict[str, float]:
        elapsed = time.perf_counter() - self.started
        return {"loss_sum": self.loss_sum, "loss_tokens": self.loss_tokens,
                "tokens": self.tokens, "elapsed_s": elapsed}

    def load_state_dict(self, state: dict[str, float] | None) -> None:
        if state is None:  # a checkpoint from before the window was saved
            return
        self.loss_sum, self.loss_tokens = state["loss_sum"], state["loss_tokens"]
        self.tokens = int(state["tokens"])
        self.started = time.perf_counter() - state["elapsed_s"]

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.loss_tokens if self.loss_tokens else math.nan

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(time.perf_counter() - self.since, 1e-9)


def log_training(run: Run, window: LogWindow, progress: Progress | None) -> None:
    last = window.last
    run.metrics.add(
        step=run.step,
        split="train",
        loss=f"{window.mean_loss:.6f}",
        lr=f"{last.lr:.6g}",
        grad_norm=f"{last.grad_norm:.4f}",
        tokens_per_s=f"{window.tokens_per_s:.1f}",
        elapsed_s=f"{time.perf_counter() - window.started:.1f}",
        tokens=run.tokens_seen,
    )
    if progress:
        progress(
            {"step": run.step, "loss": window.mean_loss, "lr": last.lr,
             "tokens_per_s": window.tokens_per_s}
        )
    window.restart()


def validate(run: Run, progress: Progress | None) -> float:
    """Validation loss of the current weights; when train.best_metric was measured and
    beats the best so far, the weights are saved to best/."""
    procs, tcfg = run.procs, run.cfg.train
    # FSDP gathers weights in every forward pass, so its processes must all run the same
    # ones; DDP's may split work whose passes depend on the data (decoding) between them.
    gather = None if tcfg.parallel == "fsdp" else lambda o: distributed.gather_objects(o, procs)
    shard = Shard(procs.rank, procs.world_size, lambda t: distributed.sum_over_ranks(t, procs),
                  gather)
    # Numbered by the step, not counted, so that a resumed run evaluates as it would have.
    index = -(-run.step // tcfg.eval_every)
    result = run.task.evaluate(run.model, max_batches=tcfg.eval_batches, shard=shard,
                               index=index)
    run.model.train()
    val = float(result["loss"])
    if run.is_main:
        measured = {k: f"{result[k]:.4f}" for k in ("bleu", "chrf") if k in result}
        run.metrics.add(step=run.step, split="val", loss=f"{val:.6f}", **measured)
        if progress:
            progress({"step": run.step, "val": result})
    if tcfg.best_metric in result:  # every rank has the same result
        value = float(result[tcfg.best_metric])
        higher = HIGHER_IS_BETTER[tcfg.best_metric]
        # A NaN never compares better; it must not become the first best either.
        if math.isfinite(value) and (
            run.best_val is None or (value > run.best_val if higher else value < run.best_val)
        ):
            run.best_val, run.evals_without_gain = value, 0
            save(run, run.run_dir / loading.BEST)
        else:
            run.evals_without_gain += 1
    return val


def save_step_checkpoint(run: Run) -> None:
    save(run, loading.step_dir(run.run_dir, run.step))
    if run.is_main:
        ckpt.prune_checkpoints(run.run_dir, run.cfg.train.keep_checkpoints)


def save(run: Run, path: Path) -> None:
    """Every rank takes part (FSDP gathers its shards); rank 0 writes."""
    procs, parallel = run.procs, run.cfg.train.parallel
    weights = distributed.full_state_dict(run.model, procs, parallel)
    optimizer_state = distributed.optimizer_state(run.model, run.optimizer, procs, parallel)
    data_states = distributed.gather_objects(run.batches.state_dict(), procs)
    carries = distributed.gather_objects(run.task.save_carry(run.carry), procs)
    rng_states = distributed.gather_objects(rng_state(), procs)
    if run.is_main:
        trainer_state = {
            "step": run.step,
            "optimizer": optimizer_state,
            "optimizer_name": run.cfg.train.optimizer,
            "data_per_rank": data_states,
            "carry_per_rank": carries,
            "rng_per_rank": rng_states,
            "best_metric": run.cfg.train.best_metric,
            "best_val": run.best_val,
            "skipped_steps": run.skipped_steps,
            "tokens_seen": run.tokens_seen,
            "evals_without_gain": run.evals_without_gain,
            "horizon": dataclasses.asdict(run.horizon),
            "log_window": run.window.state_dict(),
        }
        to_save = run.model
        if weights is not None:
            to_save = run.family.model(run.cfg.model)
            if run.cfg.train.lora is not None:
                lora.add_adapters(to_save, run.cfg.train.lora)
            to_save.load_state_dict(weights)
        ckpt.save_checkpoint(path, run.cfg, to_save, run.task.tokenizer, trainer_state,
                             lora_base=run.lora_base)
    distributed.barrier(procs)
