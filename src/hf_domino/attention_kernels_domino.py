"""The scaled_dot_product_attention kernels a drafting call runs with (`drafting_attention_kernels`): on CUDA in
float16/bfloat16, every enabled kernel but cuDNN's, whose per-shape execution plans cost more than a drafting cycle's
attention; elsewhere the process's own choice.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import contextlib
import threading

import torch


def _cudnn_eligible(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether cuDNN's attention can serve tensors on `device` in `dtype` at all: CUDA, half precision."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def cudnn_attention_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether scaled_dot_product_attention may pick cuDNN's kernels for tensors on `device` in `dtype` now: eligible,
    and the process's cuDNN switch on (a drafting call turns it off while it runs)."""
    return _cudnn_eligible(device, dtype) and torch.backends.cuda.cudnn_sdp_enabled()


def drafting_attention_kernels(
    device: torch.device, dtype: torch.dtype, allow_cudnn: bool = False
) -> contextlib.AbstractContextManager:
    """The scaled_dot_product_attention kernels a drafting call runs with: on CUDA in float16/bfloat16, every enabled
    kernel but cuDNN's; elsewhere, or with `allow_cudnn`, the process's own choice.

    PyTorch builds with a cuDNN newer than 9.15 (its CUDA 13 wheels) try cuDNN's attention first on Hopper and
    Blackwell GPUs, and cuDNN builds an execution plan for each new shape (query length, key length) before it runs
    it, which costs milliseconds where the kernel costs microseconds. Plain decoding meets each key length once per
    call and the next call finds most of them planned, but a drafting call verifies a new (drafts, context) pair at
    every cycle and the drafter attends from its block to a new context length, so each cycle pays for new plans.
    """
    if allow_cudnn or not _cudnn_eligible(device, dtype):
        return contextlib.nullcontext()
    return _cudnn_attention_off()


# cuDNN's SDPA switch is process-wide: calls that overlap (threads serving requests, a streamer's generation thread)
# share one "off", and the last one to finish puts back what the first one found.
_CUDNN_SWITCH_LOCK = threading.Lock()
_calls_without_cudnn = 0
_cudnn_switch_found = True


@contextlib.contextmanager
def _cudnn_attention_off():
    global _calls_without_cudnn, _cudnn_switch_found
    with _CUDNN_SWITCH_LOCK:
        if _calls_without_cudnn == 0:
            _cudnn_switch_found = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(False)
        _calls_without_cudnn += 1
    try:
        yield
    finally:
        with _CUDNN_SWITCH_LOCK:
            _calls_without_cudnn -= 1
            if _calls_without_cudnn == 0:
                torch.backends.cuda.enable_cudnn_sdp(_cudnn_switch_found)


__all__ = ["cudnn_attention_applies", "drafting_attention_kernels"]
