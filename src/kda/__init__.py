"""kda: Kimi Delta Attention kernels for PyTorch (Triton everywhere, CUDA on Hopper).

Public API, compatible with flash-linear-attention 0.6.0's ``fla.ops.kda``:
:func:`chunk_kda`, :func:`fused_recurrent_kda`; plus :func:`backends` (what can run here and
why not), :func:`record_dispatch` (which backend and kernels a call really used) and
:func:`register_fla_backend` (fla's own ``chunk_kda`` then runs kda).
"""

from kda.api import chunk_kda, fused_recurrent_kda
from kda.dispatch import BackendInfo, BackendUnavailableError, backends, record_dispatch
from kda.fla_backend import register_fla_backend

__version__ = "0.1.0"

__all__ = [
    "BackendInfo",
    "BackendUnavailableError",
    "__version__",
    "backends",
    "chunk_kda",
    "fused_recurrent_kda",
    "record_dispatch",
    "register_fla_backend",
]
