"""More than one process: rank, world size and the process group, for training and sampling under torchrun.

    torchrun --nproc_per_node 4 main.py --mode train --dataset cifar10 --batch_size 128   # 32 per rank
    torchrun --nproc_per_node 2 main.py --mode sample --model_path ck.pt --n_samples 256

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK in each process it starts; :func:`from_environment`
reads them, and :func:`session` joins the process group (NCCL on GPUs, gloo on CPUs) for the run.
A plain ``python main.py`` sets none of them and runs as one process, exactly as before.

Everything else asks :func:`current` two questions: "am I rank 0?" (``is_main``: only rank 0
writes files and draws progress bars) and "which part is mine?" (``share`` for a training batch,
``owns`` for sampling batches). The collectives used are here too, so the rest never imports
torch.distributed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch

# How long a collective waits for the other ranks before it fails instead of hanging. Rank 0
# alone writes checkpoints and preview grids while the others wait, so this is generous.
TIMEOUT = timedelta(minutes=30)
ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the processes of one run (one process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size or self.local_rank < 0:
            raise ValueError(
                f"rank {self.rank} of {self.world_size} (local rank {self.local_rank}) is not a valid place"
            )

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def share(self, n: int) -> slice:
        """This rank's rows of a global batch of ``n`` rows (``n`` divides by the world size)."""
        if n % self.world_size:
            raise ValueError(f"{n} rows do not split evenly over {self.world_size} ranks")
        per_rank = n // self.world_size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def owns(self, index: int) -> bool:
        """Whether item ``index`` of a list dealt round-robin (sampling batches) is this rank's."""
        return index % self.world_size == self.rank

    def label(self) -> str:
        """``"rank 1/4: "`` in a distributed run (to prefix messages every rank prints), else ``""``."""
        return f"rank {self.rank}/{self.world_size}: " if self.distributed else ""


SINGLE = Ranks()
_current = SINGLE


def from_environment(environ: dict[str, str] | None = None) -> Ranks:
    """The place torchrun gave this process (RANK, WORLD_SIZE, LOCAL_RANK), or :data:`SINGLE` without them."""
    environ = os.environ if environ is None else environ
    if "WORLD_SIZE" not in environ:
        return SINGLE
    try:
        values = {name: int(environ.get(name, "0")) for name in ENVIRONMENT}
    except ValueError:
        found = ", ".join(f"{name}={environ.get(name)!r}" for name in ENVIRONMENT)
        raise ValueError(f"the torchrun environment is not integers ({found})") from None
    return Ranks(rank=values["RANK"], world_size=values["WORLD_SIZE"], local_rank=values["LOCAL_RANK"])


def current() -> Ranks:
    """This process's ranks: set by :func:`session`, :data:`SINGLE` outside one."""
    return _current


def check_global_batch(batch_size: int, *, world_size: int) -> None:
    """A global batch must split evenly over the ranks (ValueError naming the flag otherwise)."""
    if batch_size % world_size:
        fits = max(1, batch_size // world_size) * world_size
        raise ValueError(
            f"--batch_size {batch_size} is the global batch and must divide by the {world_size} ranks training "
            f"together (each rank takes an equal share); try --batch_size {fits}, or a number of ranks that divides it"
        )


def say(*parts: object, **print_kwargs) -> None:
    """``print`` on rank 0 only: one copy of each message however many ranks run."""
    if current().is_main:
        print(*parts, **print_kwargs)


def backend() -> str:
    """The process group's backend ("nccl", "gloo"), or "none" for one process."""
    if not current().distributed:
        return "none"
    import torch.distributed as dist

    return str(dist.get_backend())


def device_of(ranks: Ranks, device: torch.device) -> torch.device:
    """The device a rank works on: its own GPU (``cuda:LOCAL_RANK``) on CUDA, the CPU otherwise."""
    if device.type != "cuda" or not ranks.distributed:
        return device
    if ranks.local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"local rank {ranks.local_rank} has no GPU: this node has {torch.cuda.device_count()}; "
            "start at most that many processes per node (--nproc_per_node)"
        )
    return torch.device("cuda", ranks.local_rank)


@contextlib.contextmanager
def session(ranks: Ranks, device: torch.device) -> Iterator[torch.device]:
    """Join the process group of a distributed run for the block (nothing for one process); yields the
    rank's device. The group is left on the way out, whatever ends the block, so no rank hangs on exit."""
    global _current
    if not ranks.distributed:
        yield device
        return
    import torch.distributed as dist

    device = device_of(ranks, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(
            backend,
            rank=ranks.rank,
            world_size=ranks.world_size,
            timeout=TIMEOUT,
            device_id=device if device.type == "cuda" else None,
        )
    except (RuntimeError, ValueError) as exc:  # e.g. no MASTER_ADDR: not started by torchrun
        from ddpm.util.messages import first_line

        raise ValueError(
            f"cannot join the other {ranks.world_size - 1} rank(s) ({first_line(exc)}); start with torchrun"
        ) from exc
    _current = ranks
    try:
        yield device
    finally:
        _current = SINGLE
        dist.destroy_process_group()


def is_collective_failure(exc: BaseException, *, ranks: Ranks | None = None) -> bool:
    """Whether ``exc`` is a collective of a distributed run that failed because another rank went away
    or timed out (NCCL raises DistError; gloo a RuntimeError that names it)."""
    if not (ranks or current()).distributed:
        return False
    try:
        from torch.distributed import DistError
    except ImportError:  # torch built without distributed
        return False
    return isinstance(exc, DistError) or "gloo" in str(exc).lower()


# ----- collectives (each a no-op for one process) ------------------------------------------------
def all_reduce_sum(tensor: torch.Tensor, *, ranks: Ranks | None = None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks (default: :func:`current`), in place; returned for chaining."""
    if (ranks or current()).distributed:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor, *, ranks: Ranks | None = None) -> torch.Tensor:
    """The element-wise maximum of ``tensor`` over the ranks, in place."""
    if (ranks or current()).distributed:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def all_gather_rows(tensor: torch.Tensor, *, ranks: Ranks | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` (equal shapes) concatenated along dim 0 in rank order: the global batch."""
    ranks = ranks or current()
    if not ranks.distributed:
        return tensor
    import torch.distributed as dist

    out = tensor.new_empty((ranks.world_size * tensor.shape[0], *tensor.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.14
    gather(out, tensor.contiguous())
    return out


def gather_to_main(item: object) -> list[object] | None:
    """Every rank's ``item`` (picklable; tensors on the CPU) on rank 0, in rank order; None elsewhere."""
    ranks = current()
    if not ranks.distributed:
        return [item]
    import torch.distributed as dist

    if isinstance(item, torch.Tensor):
        item = item.cpu()  # sync: the batch leaves the GPU (gather_object pickles)
    items = [None] * ranks.world_size if ranks.is_main else None
    dist.gather_object(item, items, dst=0)
    return items


def barrier(*, ranks: Ranks | None = None) -> None:
    """Wait until every rank is here."""
    if (ranks or current()).distributed:
        import torch.distributed as dist

        dist.barrier()
