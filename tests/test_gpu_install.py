"""The GPU extras without a GPU: the extra chosen for a driver's CUDA version, the pins in pyproject.toml
against the table of what each onnxruntime-gpu release links, and the library names a worker reports."""

from __future__ import annotations

import sys

import pytest
from packaging.specifiers import SpecifierSet

from gpu_actor.cuda_libs import extra_for, required_libraries

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
from tests.helpers import ROOT

sys.path.insert(0, str(ROOT))
import dev  # noqa: E402  (the set-up script at the top level)

EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _spec(extra: str, package: str) -> SpecifierSet:
    entry = next(e for e in EXTRAS[extra] if e.split("[")[0].split(">")[0].split("<")[0].split("=")[0] == package)
    return SpecifierSet(entry[len(package):].split("]")[-1])


@pytest.mark.parametrize("driver, extra", [((13, 0), "gpu"), ((13, 2), "gpu"), ((12, 4), "gpu-cu12"),
                                           ((12, 8), "gpu-cu12")])
def test_gpu_picks_the_build_the_driver_supports(driver, extra):
    chosen, why = dev.choose_extras("gpu", driver)
    assert chosen == extra and f"CUDA {driver[0]}.{driver[1]}" in why


def test_without_a_driver_gpu_is_refused_and_a_forced_build_is_kept():
    with pytest.raises(SystemExit) as err:
        dev.choose_extras("gpu", None)
    assert "no NVIDIA driver" in str(err.value) and "gpu-cu12" in str(err.value)
    with pytest.raises(SystemExit) as err:
        dev.choose_extras("gpu", (11, 8))
    assert "update the NVIDIA driver" in str(err.value)
    assert dev.choose_extras("gpu-cu12", None)[0] == "gpu-cu12"
    assert dev.choose_extras("gpu-cu13", None)[0] == "gpu"
    assert dev.choose_extras("cpu", None)[0] == "cpu"


@pytest.mark.parametrize("extra, cuda, inside, outside", [
    ("gpu", 13, ["1.27.0", "1.28.0", "1.31.1"], ["1.26.0", "1.22.0"]),
    ("gpu-cu12", 12, ["1.22.0", "1.24.4", "1.26.0"], ["1.27.0", "1.31.1", "1.21.1"]),
])
def test_each_extra_pins_the_onnxruntime_releases_that_link_its_cuda(extra, cuda, inside, outside):
    assert "cuda" in EXTRAS[extra][0] and "cudnn" in EXTRAS[extra][0], "the NVIDIA runtime wheels come with these"
    spec = _spec(extra, "onnxruntime-gpu")
    for version in inside:
        assert version in spec and all(f".so.{cuda}" in lib or "curand" in lib or "cudnn" in lib or "cufft" in lib
                                       for lib in required_libraries(version)), version
        assert extra_for(version) == extra
    for version in outside:
        assert version not in spec, version
    cublas = "nvidia-cublas" if cuda == 13 else "nvidia-cublas-cu12"
    assert f"{cuda}.0.0" in _spec(extra, cublas) and f"{cuda + 1}.0.0" not in _spec(extra, cublas)
    assert any(e.startswith(f"cupy-cuda{cuda}x") for e in EXTRAS[extra])


def test_required_libraries_follow_the_table():
    assert "libcudart.so.12" in required_libraries("1.26.0") and "libcudnn.so.9" in required_libraries("1.22.0")
    assert "libnvrtc.so.13" in required_libraries("1.27.0")
    assert "libcudnn.so.9" not in required_libraries("1.31.1") and "libcublasLt.so.13" in required_libraries("1.28.0")
