"""The process group of a model's ranks: its rendezvous store, joining it (NCCL on CUDA, gloo on
the CPU), each rank's device and NCCL's environment. ``tp_workers`` starts the ranks."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a hung collective (not a dead rank) ends in an error


def set_nccl_env() -> None:
    # NVLink SHARP (multicast) is off on the machines this runs on; keep NCCL from trying it.
    os.environ["NCCL_NVLS_ENABLE"] = "0"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of a rank whose index on its host is ``rank``."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def make_store(rank: int, size: int, port: int = 0, host: str = "127.0.0.1") -> dist.TCPStore:
    """The process group's rendezvous store. Rank 0 (the engine) hosts it on a port the OS
    picks as it binds (``port`` 0), before any worker starts, so no other process can take that
    port between choosing and binding it; the workers connect to ``store.port`` (at ``host``: the
    leader's address, for the ranks of other nodes)."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, size, is_master=rank == 0, timeout=COLLECTIVE_TIMEOUT,
                         wait_for_workers=False)


def init_group(device: torch.device, rank: int, size: int, store: dist.TCPStore, local: int | None = None) -> None:
    """Join the process group through ``store`` (``make_store``): NCCL on CUDA, gloo on the CPU.
    ``local``: the rank's GPU index on its host (its global rank on a single host)."""
    import torch.distributed as dist

    index = rank if local is None else local
    if device.type == "cuda":
        torch.cuda.set_device(index)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT,
                            **({"device_id": torch.device("cuda", index)} if device.type == "cuda" else {}))
