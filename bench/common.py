"""Small pieces the benchmark scripts share: atomic file writes and the versions line of a table."""

import os
import platform


def atomic_write(path, text):
    """Write text to path through a temp file and os.replace: a crash leaves the old file or the new one."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def versions():
    """'GPU <n x name>; torch ...; triton ...; Python ...' for a results table."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    if torch.cuda.is_available():
        n, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
        gpu = name if n == 1 else f"{n} x {name}"
    else:
        gpu = "none (CPU)"
    return (
        f"GPU {gpu}; torch {torch.__version__}; triton {triton_version}; Python {platform.python_version()}"
    )
