"""kvbridge's stand-in for TensorRT-LLM main: the MPI helpers the connector manager uses (not TensorRT-LLM; see kvbridge.demo.trtllm)."""

from kvbridge.demo.trtllm.dist import mpi_allgather, mpi_broadcast, mpi_rank, mpi_world_size  # noqa: F401
