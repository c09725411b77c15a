"""The CUDA libraries onnxruntime-gpu's CUDA provider links, by release, and which one is missing.

From the wheels themselves (readelf on libonnxruntime_providers_cuda.so, and each wheel's METADATA):

    onnxruntime-gpu   CUDA   links
    1.22 - 1.26       12     libcudart.so.12, libcublas(Lt).so.12, libcufft.so.11, libcurand.so.10, libcudnn.so.9
    1.27              13     libcudart.so.13, libcublas(Lt).so.13, libcufft.so.12, libcurand.so.10, libnvrtc.so.13,
                             libcudnn.so.9
    1.28 - 1.31       13     libcudart.so.13, libcublas(Lt).so.13, libcurand.so.10

The library has no RUNPATH: `onnxruntime.preload_dlls()` (1.26 and later) loads the ones pip installed
(NVIDIA's wheels, pulled by the `cuda,cudnn` extras and, for cuBLAS, named by ours) before a session
needs them.
"""

from __future__ import annotations

import ctypes

CUDA12 = ("libcudart.so.12", "libcublas.so.12", "libcublasLt.so.12", "libcufft.so.11", "libcurand.so.10",
          "libcudnn.so.9")
CUDA13_127 = ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcufft.so.12", "libcurand.so.10",
              "libnvrtc.so.13", "libcudnn.so.9")
CUDA13 = ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcurand.so.10")


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def required_libraries(ort_version: str) -> tuple[str, ...]:
    release = _release(ort_version)
    if release < (1, 27):
        return CUDA12
    if release == (1, 27):
        return CUDA13_127
    return CUDA13


def extra_for(ort_version: str) -> str:
    """The pyproject extra that installs this onnxruntime-gpu release's CUDA libraries."""
    return "gpu-cu12" if _release(ort_version) < (1, 27) else "gpu"


def preload() -> None:
    """Load pip's NVIDIA libraries into the process (onnxruntime >= 1.26; a no-op before)."""
    import onnxruntime as ort
    if hasattr(ort, "preload_dlls"):
        try:
            ort.preload_dlls()
        except Exception:   # a missing library is reported by missing_libraries(), with what to install
            pass


def missing_libraries(ort_version: str) -> list[str]:
    missing = []
    for name in required_libraries(ort_version):
        try:
            ctypes.CDLL(name)
        except OSError:
            missing.append(name)
    return missing
