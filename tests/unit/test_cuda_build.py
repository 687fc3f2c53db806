"""Building CUDA sources into the kernel cache with the machine's nvcc, and loading them.

The builds are real nvcc runs (skipped where there is none); nothing here needs a GPU.
"""

import ctypes
import os
import stat

import pytest

from rnnt.kernels import cuda_build

NVCC = cuda_build.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")
# `nvcc -shared` compiles a host-only source too: the cache logic is the same, in a second.
FLAGS = ("-O1", "-Xcompiler", "-fPIC", "-shared")
ADD = 'extern "C" int add(int a, int b) { return a + b + OFFSET; }\n'


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(cuda_build.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def write(path, offset):
    path.write_text(f"#define OFFSET {offset}\n" + ADD)
    return path


def call_add(lib_path, a, b):
    lib = ctypes.CDLL(str(lib_path))
    lib.add.argtypes = [ctypes.c_int, ctypes.c_int]
    return lib.add(a, b)


@needs_nvcc
def test_a_build_is_cached_and_a_changed_source_builds_anew(tmp_path, cache):
    src = write(tmp_path / "adder.cu", 0)
    first = cuda_build.build(src, FLAGS)
    assert first.parent == cache and first.name.startswith("adder-")
    assert call_add(first, 2, 3) == 5
    built_at = first.stat().st_mtime_ns
    assert cuda_build.build(src, FLAGS) == first and first.stat().st_mtime_ns == built_at
    # another source text or other flags: another library, the first one untouched
    second = cuda_build.build(write(src, 10), FLAGS)
    assert second != first and call_add(second, 2, 3) == 15
    assert cuda_build.build(src, (*FLAGS, "-DUNUSED")) not in (first, second)
    assert call_add(first, 2, 3) == 5
    # only finished libraries are in the cache: no temporary files left behind
    assert all(not p.name.startswith(".") for p in cache.iterdir())


@needs_nvcc
def test_an_edited_header_builds_anew(tmp_path, cache):
    (tmp_path / "inc").mkdir()
    header = tmp_path / "inc" / "offset.cuh"
    (tmp_path / "inc" / "outer.cuh").write_text('#include "offset.cuh"\n')
    src = tmp_path / "adder.cu"
    src.write_text('#include "inc/outer.cuh"\n#include <stdint.h>\n' + ADD)
    header.write_text("#define OFFSET 1\n")
    assert cuda_build.source_closure(src) == [src, tmp_path / "inc/outer.cuh", header]
    first = cuda_build.build(src, FLAGS)
    assert call_add(first, 2, 3) == 6
    header.write_text("#define OFFSET 100\n")  # two includes deep
    second = cuda_build.build(src, FLAGS)
    assert second != first and call_add(second, 2, 3) == 105


@needs_nvcc
def test_a_compile_error_names_the_source_and_leaves_nothing_in_the_cache(tmp_path, cache):
    src = tmp_path / "broken.cu"
    src.write_text('extern "C" int f() { return undeclared_name; }\n')
    with pytest.raises(cuda_build.BuildError, match="undeclared_name") as info:
        cuda_build.build(src, FLAGS)
    assert "broken.cu" in str(info.value) and "exited with" in str(info.value)
    assert list(cache.iterdir()) == []


def test_without_nvcc_the_error_says_how_to_point_at_one(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: None)
    with pytest.raises(cuda_build.BuildError, match="CUDA_HOME"):
        cuda_build.build(write(tmp_path / "adder.cu", 0), FLAGS)


@needs_nvcc
def test_an_unwritable_cache_names_the_variable_that_moves_it(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(cuda_build.CACHE_ENV, str(blocker / "cache"))
    with pytest.raises(cuda_build.BuildError, match=cuda_build.CACHE_ENV):
        cuda_build.build(write(tmp_path / "adder.cu", 0), FLAGS)


def test_cuda_home_s_nvcc_comes_first(tmp_path, monkeypatch):
    fake_bin = tmp_path / "toolkit" / "bin"
    fake_bin.mkdir(parents=True)
    nvcc = fake_bin / "nvcc"
    nvcc.write_text("#!/bin/sh\nexit 0\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "toolkit"))
    assert cuda_build.find_nvcc() == nvcc
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nowhere"))
    assert cuda_build.find_nvcc() != nvcc


def test_the_default_cache_is_under_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(cuda_build.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cuda_build.cache_dir() == tmp_path / "rnnt-mlperf"
    monkeypatch.setenv(cuda_build.CACHE_ENV, os.fspath(tmp_path / "elsewhere"))
    assert cuda_build.cache_dir() == tmp_path / "elsewhere"
