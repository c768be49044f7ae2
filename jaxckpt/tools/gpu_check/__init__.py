"""``make gpu-check``: the CUDA paths of both packages run on the GPUs of this machine.

The package's modules, by concept: ``rows`` (a result row, the markdown table, a part's
outcome written as JSON by the child that ran it), ``runner`` (finding what is usable,
running each part in a child process under its own time limit, the command line),
``jax_parts`` (sharded round trips, async blocking and throughput, kill and resume) and
``torch_parts`` (DcpCheckpointManager on CUDA, and two ranks over NCCL). Run it as
``python -m jaxckpt.tools.gpu_check``; ``--cpu`` runs the same parts on CPU devices with tiny
sizes (the tests do).

Must not import at module level: jax, orbax, torch.
"""

from __future__ import annotations

from .runner import main

__all__ = ["main"]
