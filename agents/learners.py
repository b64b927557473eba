"""Data-parallel learners: ``num_learners`` Ray actors, each holding the whole learner state, share every update.

Each learner gets the same rollout and makes the same seeded choices (minibatch order, replay samples, advantage
normalisation over the whole minibatch), then runs forward/backward on only its slice of each minibatch's rows.
``DistributedSync`` weights its gradients by the slice's share of the rows and sums them over the learners with one
all-reduce of a flat buffer (torch.distributed: gloo on CPU, NCCL on CUDA; both ring all-reduce), which is the
gradient of the whole minibatch's mean loss. Every learner then clips and steps on the same gradient, so their
states stay identical and learner 0's state is the run's state: the driver's rollout weights after each update,
checkpoints, resume and the final trainer.

Why torch.distributed inside Ray actors and not Ray Train's ``TorchTrainer``: ``TorchTrainer`` owns the training loop
(one ``train_loop_per_worker`` call with its own checkpoint and failure machinery), while here the RL core's loop
(collect on the rollout workers, update, checkpoint, bit-exact resume) stays in the trainer and the learners are a
long-lived group it calls once per update. Why not ``DistributedDataParallel``: DDP reduces only gradients produced
through its wrapper's ``forward`` and divides by the world size; the policies are called through
``evaluate_actions``/``preprocess``, and uneven slices need row weights. One flat buffer is what DDP's bucketing
would send for these small networks anyway.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from opentinker.envs.rollout import Rollout

Trainer = Any
"""An ``agents.trainer.Trainer`` (not imported: the trainer imports this module)."""

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


class LearnerGroupError(RuntimeError):
    """A learner process died or its collective failed; ``train`` restarts the group from the last checkpoint."""


class GradientSync(Protocol):
    """How an update shares its work with the other learners (``LocalSync`` when it is alone)."""

    def shard(self, rows: int) -> slice: ...

    def reduce(self, params: list[torch.nn.Parameter]) -> None: ...

    def average(self, values: torch.Tensor) -> torch.Tensor: ...


class LocalSync:
    """One learner: every row of each minibatch, nothing to share."""

    def shard(self, rows: int) -> slice:
        return slice(None)

    def reduce(self, params: list[torch.nn.Parameter]) -> None:
        pass

    def average(self, values: torch.Tensor) -> torch.Tensor:
        return values


class DistributedSync:
    """Learner ``rank`` of ``world``: a contiguous slice of each minibatch; gradients and statistics are
    row-weighted and summed over the learners. Counts the time and bytes it all-reduces."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.weight = 1.0
        self.allreduce_s, self.allreduce_bytes = 0.0, 0

    def shard(self, rows: int) -> slice:
        if rows < self.world:
            raise ValueError(f"a minibatch of {rows} rows cannot be split across num_learners={self.world}")
        bounds = [rows * r // self.world for r in range(self.world + 1)]
        self.weight = (bounds[self.rank + 1] - bounds[self.rank]) / rows
        return slice(bounds[self.rank], bounds[self.rank + 1])

    def _all_reduce(self, flat: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        dist.all_reduce(flat)
        self.allreduce_s += time.perf_counter() - started
        self.allreduce_bytes += flat.numel() * flat.element_size()
        return flat

    def reduce(self, params: list[torch.nn.Parameter]) -> None:
        """Replace each gradient by the row-weighted sum over learners (= the whole minibatch's gradient)."""
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        flat = self._all_reduce(torch.cat([g.reshape(-1) for g in grads]) * self.weight)
        for param, grad in zip(params, flat.split([p.numel() for p in params])):
            param.grad = grad.view_as(param)

    def average(self, values: torch.Tensor) -> torch.Tensor:
        """Row-weighted mean over learners of per-slice means: the whole minibatch's statistics."""
        return self._all_reduce(values.detach().float() * self.weight)


class LearnerWorker:
    """One learner process (a Ray actor): a trainer without env copies, joined to the group's process group."""

    def __init__(
        self,
        rank: int,
        world: int,
        backend: str,
        trainer_cls: type,
        spaces: Any,
        seed: int,
        amp_mode: str,
        config: dict,
    ):
        from opentinker.envs.ray_backend import this_node

        torch.set_num_threads(config.get("torch_threads") or 1)  # actors see every core; the group shares them
        self.rank, self.world, self.backend = rank, world, backend
        self.host, has_gpu = this_node()
        self.device = "cuda" if has_gpu else "cpu"
        self.trainer = trainer_cls(spaces, seed=seed, device=self.device, amp_mode=amp_mode, **config)
        # Rank 0 hosts the rendezvous store on a port the OS picks (no free-port race), before anyone joins.
        self.store = dist.TCPStore(self.host, 0, world, is_master=True, wait_for_workers=False) if rank == 0 else None

    def store_address(self) -> tuple[str, int]:
        return self.host, self.store.port

    def join(self, host: str, port: int, state: dict) -> None:
        """Join the process group (a rendezvous: every rank's ``join`` must be running at once) and load ``state``."""
        store = self.store or dist.TCPStore(host, port, self.world, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        dist.init_process_group(
            self.backend,
            store=store,
            rank=self.rank,
            world_size=self.world,
            timeout=COLLECTIVE_TIMEOUT,
        )
        self.trainer.load_learner_state(state)
        self.trainer.sync = DistributedSync(self.rank, self.world)

    def update(self, rollout: Rollout) -> tuple[dict[str, float], dict[str, torch.Tensor], int] | None:
        """The algorithm's update on this learner's slices; learner 0 returns metrics, weights and global step."""
        sync = self.trainer.sync
        sync.allreduce_s, sync.allreduce_bytes = 0.0, 0
        metrics = self.trainer.update(rollout)
        if self.rank != 0:
            return None
        metrics["perf/allreduce_ms"] = sync.allreduce_s * 1000.0
        metrics["perf/allreduce_bytes"] = float(sync.allreduce_bytes)
        weights = {k: v.detach().cpu() for k, v in self.trainer.policy.state_dict().items()}
        return metrics, weights, self.trainer.global_step

    def state(self) -> dict:
        return self.trainer.learner_state()

    def time_allreduce(self, numel: int, repeats: int) -> float:
        """Mean seconds of one all-reduce of ``numel`` float32 after a barrier: the transport's cost without the
        waiting on a slower learner that the update's ``perf/allreduce_ms`` includes."""
        flat = torch.zeros(numel, device=self.device)
        dist.all_reduce(flat)  # connect
        dist.barrier()
        started = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(flat)
        return (time.perf_counter() - started) / repeats

    def pid(self) -> int:
        import os

        return os.getpid()


def learner_gpus(device_type: str, num_learners: int, cluster_gpus: float) -> tuple[float, str]:
    """(GPUs per learner, torch.distributed backend): on CUDA a GPU each with NCCL when the cluster has one per
    learner; else an equal share of the GPUs with gloo (NCCL refuses two ranks on one device). CPU: gloo."""
    if device_type != "cuda":
        return 0.0, "gloo"
    if cluster_gpus <= 0:
        raise ValueError(f"num_learners={num_learners} on device cuda: the Ray cluster has no GPU")
    if cluster_gpus >= num_learners:
        return 1.0, "nccl"
    return 1.0 / math.ceil(num_learners / cluster_gpus), "gloo"  # shares that pack whole GPUs


class LearnerGroup:
    """``num_learners`` ``LearnerWorker`` actors started from ``trainer``'s current learner state."""

    def __init__(self, trainer: Trainer, num_learners: int):
        from opentinker.envs.base import EnvSpaces
        from opentinker.envs.ray_backend import RayGang, cluster_gpus

        spaces = EnvSpaces(trainer.env_id, trainer.observation_space, trainer.action_space)
        gpus, backend = learner_gpus(trainer.device.type, num_learners, cluster_gpus())
        config = vars(trainer.config)
        args = [
            (r, num_learners, backend, type(trainer), spaces, trainer.seed, trainer.amp.requested, config)
            for r in range(num_learners)
        ]
        # No CPU reservation: learners must not wait behind rollout actors for a slot; their torch threads are set.
        self.gang = RayGang(LearnerWorker, args, {"num_cpus": 0, "num_gpus": gpus}, LearnerGroupError)
        host, port = self.gang.call_one(0, "store_address")
        self.gang.call("join", broadcast=(host, port, trainer.learner_state()))  # every rank joins at once

    def update(self, rollout: Rollout) -> tuple[dict[str, float], dict[str, torch.Tensor], int]:
        return self.gang.call("update", broadcast=(rollout,))[0]

    def state(self) -> dict:
        return self.gang.call_one(0, "state")

    def time_allreduce(self, numel: int, repeats: int = 20) -> float:
        """Learner 0's mean seconds per all-reduce of ``numel`` float32 (see ``LearnerWorker.time_allreduce``)."""
        return self.gang.call("time_allreduce", broadcast=(numel, repeats))[0]

    def pids(self) -> list[int]:
        return self.gang.call("pid")

    def shutdown(self) -> None:
        self.gang.close()


@contextlib.contextmanager
def learner_group(trainer: Trainer) -> Iterator[None]:
    """With ``num_learners > 1``: ``trainer.learners`` runs the updates for the block; at the end the trainer
    takes learner 0's state (so ``evaluate``, ``save`` and exports see the trained policy)."""
    if trainer.config.num_learners == 1:
        yield
        return
    trainer.learners = LearnerGroup(trainer, trainer.config.num_learners)
    try:
        yield
        trainer.load_learner_state(trainer.learners.state())
    finally:
        if trainer.learners is not None:  # None when a restart found no checkpoint
            trainer.learners.shutdown()
            trainer.learners = None


def restart_learners(trainer: Trainer, checkpoint: Any) -> None:
    """A learner died: restore the trainer from ``checkpoint`` (a path, or None) and start a fresh group from it.

    The checkpoint holds learner 0's state, the env workers' state and every RNG, and the update is deterministic
    (same seeded choices on every learner, a fixed reduction order), so the replayed iterations compute exactly what
    the lost ones would have."""
    trainer.learners.shutdown()
    trainer.learners = None
    if checkpoint is None or not checkpoint.exists():
        raise LearnerGroupError(
            "a learner died and there is no checkpoint to restart the learner group from "
            "(train with checkpoint_dir and checkpoint_every)"
        )
    trainer.restore(checkpoint)
    trainer.learners = LearnerGroup(trainer, trainer.config.num_learners)
