"""The machine a benchmark ran on, recorded next to its numbers."""
from __future__ import annotations

import datetime
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def cpu_model() -> str:
    info = _read("/proc/cpuinfo") or ""
    for line in info.splitlines():
        if line.lower().startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_clock_mhz() -> dict:
    clocks = {}
    for key, name in (("max_mhz", "cpuinfo_max_freq"), ("current_mhz", "scaling_cur_freq")):
        raw = _read(f"/sys/devices/system/cpu/cpu0/cpufreq/{name}")
        if raw and raw.isdigit():
            clocks[key] = int(raw) / 1000
    if "current_mhz" not in clocks:
        for line in (_read("/proc/cpuinfo") or "").splitlines():
            if line.lower().startswith("cpu mhz"):
                clocks["current_mhz"] = float(line.split(":", 1)[1])
                break
    return clocks


def _nvidia_smi_clocks() -> dict:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    fields = "clocks.sm,clocks.max.sm,clocks.mem,power.limit,driver_version"
    try:
        out = subprocess.run([exe, f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    parts = [p.strip() for p in out.split(",")]
    return dict(zip(("sm_mhz", "max_sm_mhz", "mem_mhz", "power_limit_w", "driver"), parts)) if len(parts) == 5 else {}


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages: how busy the machine was (timings on a shared CPU are noisy)."""
    raw = _read("/proc/loadavg")
    try:
        return [float(x) for x in raw.split()[:3]] if raw else None
    except ValueError:
        return None


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None


def collect(device) -> dict:
    device = torch.device(device)
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device_type": device.type,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_clocks": cpu_clock_mhz(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "load_average": load_average(),
        "attnzoo_commit": _git_commit(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, gpu_memory_bytes=int(props.total_memory),
                   compute_capability=f"{props.major}.{props.minor}", gpu_clocks=_nvidia_smi_clocks())
    else:
        env["device_name"] = env["cpu_model"]
    return env


def device_name(device) -> str:
    """The name ``collect`` records, without collecting the rest."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).name
    return cpu_model()


def unusable_device(device) -> str | None:
    """Why ``device`` cannot run a benchmark here, in one line, or None when it can: a CUDA device
    asked for where none is visible (torch's own error is a traceback about drivers), an index past
    the visible devices, or another device type torch cannot allocate on."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"no CUDA device is visible (torch.cuda.is_available() is False), so --device {device} cannot run"
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            return f"--device {device}: only {count} CUDA device{'s are' if count != 1 else ' is'} visible"
        return None
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return f"--device {device} cannot be used here: {first}"
    return None
