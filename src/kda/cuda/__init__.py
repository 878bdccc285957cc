"""The ``cuda`` backend: hand-written Hopper kernels loaded through cuda-python.

The kernels are not part of this release: the backend reports itself unavailable, with the
reason, and ``backend="auto"`` falls through to Triton.
"""

from __future__ import annotations

import torch

from kda.validation import Problem


class CudaBackend:
    name = "cuda"

    def availability(self) -> str | None:
        return "CUDA kernels not built: this release ships no compiled kernel artefact"

    def rejects(self, problem: Problem) -> str | None:
        return "CUDA kernels not built"

    def run(self, problem: Problem) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise RuntimeError("the cuda backend is not available")


BACKEND = CudaBackend()
