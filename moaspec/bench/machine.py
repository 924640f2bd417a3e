"""The machine a benchmark or tuning ran on: the `machine` object of results.json (torch and
transformers are imported when it is asked for, not before). The CPU is named as the machine
calibration names it: /proc/cpuinfo's model name and the flags that change kernels."""

from __future__ import annotations

import os
import platform

from moaspec.calibration.machine import cpu_description


def machine_info() -> dict:
    import torch
    import transformers

    cpu = cpu_description()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu only"
    description = (
        f"{cpu}, {os.cpu_count()} CPUs ({torch.get_num_threads()} torch threads), {device}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, {platform.system()} {platform.release()}"
    )
    return {
        "description": description,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
