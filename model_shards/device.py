"""Where a model runs and in what precision (`engine.device` and `model.dtype` in the config tree).
"auto" means the GPU when this process has one (CUDA), else the CPU, and bfloat16 on a GPU,
float32 on the CPU (where bf16 matmuls are mostly slower, and fp32 matches transformers).
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """"auto" | "cpu" | "cuda" | "cuda:N" -> a torch.device this process can use (clear error if not)."""
    if isinstance(name, torch.device):
        name = str(name)
    if name == "auto":
        return _auto_device()
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device: must be one of {DEVICES} (or cuda:N), got {name!r}") from e
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: must be one of {DEVICES} (or cuda:N), got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' asked for, but this process sees no CUDA GPU "
                         "(on Ray, give the deployment or shard num_gpus)")
    return device


@functools.cache
def _auto_device() -> torch.device:
    """What "auto" means in this process, said once in its log: a GPU left unused by mistake (a
    replica without num_gpus, a CPU build of torch) shows there."""
    if torch.cuda.is_available():
        log.info("device auto: cuda (%s, %d visible)", torch.cuda.get_device_name(), torch.cuda.device_count())
        return torch.device("cuda")
    gpu_build = torch.version.cuda or torch.version.hip
    why = f"no GPU visible to its {gpu_build} build" if gpu_build else "a CPU-only build"
    log.info("device auto: cpu (torch %s: %s)", torch.__version__, why)
    return torch.device("cpu")


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" -> bfloat16 on a GPU, float32 on the CPU; other names -> that torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype: must be one of {DTYPES}, got {name!r}")
    return getattr(torch, name)


def collective_backend(device: torch.device) -> str:
    """The torch.distributed backend for tensors on `device`: NCCL for CUDA tensors, gloo for CPU ones."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"
