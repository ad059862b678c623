"""Host and GPU readings for the monitor, taken only when asked for.

    stats = SystemStats()
    stats.read()   # {"system/cpu_pct": 97.0, "system/rss_gib": 3.1, "system/gpu_util_pct": 88.0, ...}

GPU figures come from NVML (the ``pynvml`` module of the ``nvidia-ml-py`` package) and describe the
whole device this process computes on, not just this process's share of it. Anything that can go
wrong there (the module or the driver library missing, no GPU, a query the device does not support,
a driver error) only drops the affected keys: `read` never raises because of NVML. Host figures come
from psutil and are always present.
"""

from __future__ import annotations

import os
from typing import Any

import psutil
import torch

__all__ = ["SystemStats"]

_GIB = float(1 << 30)

# Keys `read` can return. The GPU ones are missing whenever NVML cannot answer.
CPU_PCT = "system/cpu_pct"
RSS_GIB = "system/rss_gib"
GPU_UTIL_PCT = "system/gpu_util_pct"
GPU_MEM_USED_GIB = "system/gpu_mem_used_gib"
GPU_MEM_TOTAL_GIB = "system/gpu_mem_total_gib"
GPU_POWER_W = "system/gpu_power_w"
GPU_TEMP_C = "system/gpu_temp_c"


class SystemStats:
    """Read this process's CPU and memory use and its GPU's state, on demand.

    Args:
        device: the CUDA device to report on: an ordinal as CUDA numbers them inside this process (so
            ``0`` is the first entry of ``CUDA_VISIBLE_DEVICES``), or a ``torch.device``. By default,
            the current CUDA device, picked up at the first `read` after this process has initialised
            CUDA; a process that never touches CUDA reports no GPU figures (and the monitor does not
            create a CUDA context on its behalf).
        gpu: set False to skip NVML altogether.

    The CUDA ordinal is turned into an NVML device by the device's UUID when torch can report it, and
    otherwise through ``CUDA_VISIBLE_DEVICES`` (indices or ``GPU-``/``MIG-`` UUIDs): NVML numbers all
    of the machine's GPUs, whatever this process can see.
    """

    def __init__(self, device: int | torch.device | None = None, *, gpu: bool = True) -> None:
        if isinstance(device, torch.device):
            if device.type != "cuda":
                gpu = False
                device = None
            else:
                device = device.index
        if device is not None and (not isinstance(device, int) or isinstance(device, bool) or device < 0):
            raise ValueError(f"device must be a non-negative CUDA ordinal or a torch.device, got {device!r}")
        self._device = device
        self._nvml: Any = None       # the pynvml module once initialised
        self._handle: Any = None
        self._gpu_failed = not gpu   # True once NVML has proven unusable: stop trying
        self._process = psutil.Process()
        # cpu_percent(None) measures since the previous call; this first call starts the clock.
        self._process.cpu_percent(None)

    # ------------------------------------------------------------------ public
    def read(self) -> dict[str, float]:
        """Current readings: host keys always, GPU keys when NVML can give them."""
        out: dict[str, float] = {}
        try:
            out[CPU_PCT] = float(self._process.cpu_percent(None))
            out[RSS_GIB] = self._process.memory_info().rss / _GIB
        except psutil.Error:
            pass
        if not self._gpu_failed:
            handle = self._gpu_handle()
            if handle is not None:
                self._read_gpu(handle, out)
        return out

    def use_current_device(self) -> None:
        """Report on this thread's current CUDA device from now on, if no device was given and this
        process has initialised CUDA (otherwise nothing changes). CUDA keeps the current device per
        thread: call this on the training thread before `read` runs on another one (the monitor's
        writer), which would otherwise see its own (device 0)."""
        if self._device is not None or self._gpu_failed or self._handle is not None:
            return
        try:
            if torch.cuda.is_initialized():
                self._device = torch.cuda.current_device()
        except Exception:
            pass

    def close(self) -> None:
        """Release NVML (safe to call twice)."""
        nvml, self._nvml, self._handle = self._nvml, None, None
        self._gpu_failed = True
        if nvml is not None:
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass

    def __enter__(self) -> "SystemStats":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------- private
    def _gpu_handle(self) -> Any:
        if self._handle is not None:
            return self._handle
        ordinal = self._device
        if ordinal is None:
            # Do not initialise CUDA from here: wait until the training code has.
            try:
                if not torch.cuda.is_initialized():
                    return None
                ordinal = torch.cuda.current_device()
            except Exception:
                self._gpu_failed = True
                return None
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:
            # Module missing, driver library missing, no GPU, or any other NVML failure.
            self._gpu_failed = True
            return None
        self._nvml = pynvml
        handle = _handle_for(pynvml, ordinal)
        if handle is None:
            self.close()
            return None
        self._handle = handle
        return handle

    def _read_gpu(self, handle: Any, out: dict[str, float]) -> None:
        nvml = self._nvml
        # Each query on its own: a device may support some and not others (MIG has no utilisation).
        try:
            out[GPU_UTIL_PCT] = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception:
            pass
        try:
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            out[GPU_MEM_USED_GIB] = mem.used / _GIB
            out[GPU_MEM_TOTAL_GIB] = mem.total / _GIB
        except Exception:
            pass
        try:
            out[GPU_POWER_W] = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0  # milliwatts
        except Exception:
            pass
        try:
            out[GPU_TEMP_C] = float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
        except Exception:
            pass


def _handle_for(nvml: Any, ordinal: int) -> Any:
    """The NVML handle of CUDA device `ordinal` of this process, or None."""
    uuid = _torch_uuid(ordinal)
    if uuid is not None:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception:
            pass
    target: str = str(ordinal)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() != "":
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if ordinal >= len(entries):
            return None
        target = entries[ordinal]
    try:
        if target.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(target))
        return nvml.nvmlDeviceGetHandleByUUID(target)
    except Exception:
        return None


def _torch_uuid(ordinal: int) -> str | None:
    """``GPU-...`` UUID of CUDA device `ordinal` as torch sees it, when CUDA is up and torch says."""
    try:
        if not torch.cuda.is_initialized():
            return None
        uuid = getattr(torch.cuda.get_device_properties(ordinal), "uuid", None)
    except Exception:
        return None
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
