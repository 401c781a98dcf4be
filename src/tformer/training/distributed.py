"""Several processes, one model: torchrun's environment, DistributedDataParallel or FSDP.

Every rank draws the same global batch from the same data state and trains on its own
contiguous slice of the rows (`shard`). The data state is therefore the same on every rank
and in every checkpoint, so a run resumes with any number of processes, and gradients are
normalised by the global token count, so the result does not depend on how many processes
produced it (up to the order of floating-point sums).

    torchrun --nproc_per_node=N -m tformer train CONFIG --out RUN_DIR
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tformer.errors import TformerError
from tformer.training.device import pick_device


@dataclass(frozen=True)
class Processes:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def from_environment() -> Processes:
    """The process layout torchrun describes in RANK / WORLD_SIZE / LOCAL_RANK (one process
    when they are absent)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return Processes(
        rank=int(os.environ.get("RANK", "0")),
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )


def setup(device_name: str) -> tuple[Processes, torch.device]:
    """Join torchrun's process group (gloo on CPU, nccl on CUDA) and pick this rank's device."""
    procs = from_environment()
    device = pick_device(device_name)
    if not procs.distributed:
        return procs, device
    if device.type == "cuda":
        device = torch.device("cuda", procs.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return procs, device


def teardown() -> None:
    """Leave the process group in the order that lets every rank exit cleanly: DDP wrappers
    (whose reducers hold the group and its pending gloo work) collected first (the caller
    drops its references before calling), then a barrier, so that no rank closes its
    connections while another still waits on a message from it, then the group. A rank that
    closed first could make the other abort at exit with "terminate called without an
    active exception"."""
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def wrap(model: nn.Module, procs: Processes, device: torch.device, strategy: str) -> nn.Module:
    """The module the training step runs: the model itself, DDP around it, or the model
    sharded in place by FSDP (one unit per block, then the rest)."""
    if not procs.distributed:
        return model
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        # One unit per block of every stack (the entries of the model's ModuleLists).
        for module in list(model.modules()):
            if isinstance(module, nn.ModuleList):
                for block in module:
                    fully_shard(block)
        fully_shard(model)
        return model
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def shard(batch: Any, procs: Processes) -> Any:
    """This rank's contiguous slice of every batch-first tensor in a batch dataclass."""
    if not procs.distributed:
        return batch
    changes = {}
    for field in dataclasses.fields(batch):
        value = getattr(batch, field.name)
        if isinstance(value, Tensor) and value.dim() > 0:
            if value.shape[0] < procs.world_size:
                raise TformerError(
                    f"a batch of {value.shape[0]} rows cannot be split across "
                    f"{procs.world_size} processes; raise the batch size"
                )
            changes[field.name] = value.tensor_split(procs.world_size)[procs.rank]
    return dataclasses.replace(batch, **changes)


@contextlib.contextmanager
def no_sync(train_model: nn.Module, *, skip: bool) -> Iterator[None]:
    """Skip DDP's gradient all-reduce for micro-batches before the last of a step."""
    if skip and isinstance(train_model, nn.parallel.DistributedDataParallel):
        with train_model.no_sync():
            yield
    else:
        yield


def sum_over_ranks(values: Tensor, procs: Processes) -> Tensor:
    if procs.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def broadcast_from_main(value: Tensor, procs: Processes) -> Tensor:
    if procs.distributed:
        dist.broadcast(value, src=0)
    return value


def barrier(procs: Processes) -> None:
    if procs.distributed:
        dist.barrier()


def gather_objects(obj: Any, procs: Processes) -> list[Any]:
    """Every rank's `obj`, in rank order (a one-item list with one process)."""
    if not procs.distributed:
        return [obj]
    out: list[Any] = [None] * procs.world_size
    dist.all_gather_object(out, obj)
    return out


def full_state_dict(model: nn.Module, procs: Processes, strategy: str) -> dict[str, Tensor] | None:
    """The whole model's weights as ordinary tensors (gathered from FSDP shards)."""
    if strategy != "fsdp" or not procs.distributed:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, procs: Processes, strategy: str
) -> dict[str, Any]:
    """The optimizer's whole state (gathered from FSDP shards).

    Without FSDP this is the optimizer's own state dict, also for Muon with AdamW
    (training.optimizer.MuonWithAdamW): under DDP every rank steps the whole matrices with
    the same averaged gradients. FSDP with Muon is refused when the config loads
    (TrainConfig.check_muon): each rank holds a slice of every matrix, and Muon's
    orthogonalisation is of the whole matrix.
    """
    if strategy != "fsdp" or not procs.distributed:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    return get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def load_optimizer_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    procs: Processes,
    strategy: str,
) -> None:
    if strategy != "fsdp" or not procs.distributed:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    set_optimizer_state_dict(
        model, optimizer, state, options=StateDictOptions(full_state_dict=True)
    )
