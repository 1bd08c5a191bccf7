"""The MPI collectives TensorRT-LLM's executor and connector manager use
(``tensorrt_llm/_utils.py``: ``mpi_rank``, ``mpi_world_size``, ``mpi_broadcast``,
``mpi_allgather``), over whatever connects the stand-in's rank processes.

A rank process installs its communicator once (``install``); without one, a process is
rank 0 of 1 and collectives return their own argument, as MPI does with one rank.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Communicator", "install", "mpi_rank", "mpi_world_size", "mpi_broadcast", "mpi_allgather"]


class Communicator(Protocol):
    rank: int
    size: int

    def broadcast(self, obj: Any, root: int) -> Any: ...

    def allgather(self, obj: Any) -> list: ...


_COMM: Communicator | None = None


def install(comm: Communicator | None) -> None:
    """Make ``comm`` this process's MPI communicator (None: rank 0 of 1)."""
    global _COMM
    _COMM = comm


def mpi_rank() -> int:
    return _COMM.rank if _COMM is not None else 0


def mpi_world_size() -> int:
    return _COMM.size if _COMM is not None else 1


def mpi_broadcast(obj: Any, root: int = 0) -> Any:
    """Every rank calls it in the same order; each gets rank ``root``'s ``obj``."""
    return _COMM.broadcast(obj, root) if _COMM is not None else obj


def mpi_allgather(obj: Any) -> list:
    """Every rank calls it in the same order; each gets every rank's ``obj``, in rank order."""
    return _COMM.allgather(obj) if _COMM is not None else [obj]
