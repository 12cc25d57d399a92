"""Build cgraph: the C half (csrc/*.c) compiled as C11 into a static library,
linked with the C++ half (csrc/aten_*.cpp, compiled against torch) into
cgraph/_C.so.

torch's BuildExtension compiles every source as C++, so the C files go
through setuptools' build_clib instead and are linked in whole (nothing in
the C++ half references PyInit__C, so a plain -l would drop it).  The module
exports PyInit__C only (hidden visibility and csrc/exports.map).

pip runs this through _backend/cgraph_backend.py, which gives an isolated
build the installed torch's release; `pip install --no-build-isolation .`
builds against the installed torch directly (recommended, and faster).
"""
import glob
import importlib.util
import os
import shutil
import subprocess
import sysconfig

import setuptools
from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
C_LIBRARY = "cgraph_c"
MIN_SETUPTOOLS = 77  # as pyproject.toml's build-system requires
# Linked in with --version-script: the module exports PyInit__C and nothing else.
EXPORTS_MAP = os.path.join(HERE, "csrc", "exports.map")


def _cuda_check():
    """cgraph/_cuda_check.py, loaded by path: importing the cgraph package
    would load its extension, which is what is being built."""
    spec = importlib.util.spec_from_file_location(
        "_cgraph_cuda_check", os.path.join(HERE, "cgraph", "_cuda_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_cuda_torch(torch):
    """Stop the build with one sentence where torch is not a CUDA build;
    torch's cpp_extension would fail later with "CUDA_HOME environment
    variable is not set", nvcc installed or not."""
    check = _cuda_check()
    check.require_cuda_torch(torch, SystemExit, check.HOW_TO_BUILD)


def check_setuptools(version):
    """Stop with one sentence where setuptools cannot read pyproject.toml's
    license expression (PEP 639, setuptools 77; a Python 3.11 venv starts
    with 65): its own error is 90 lines of schema.  Only a build without
    isolation meets this; an isolated one gets pyproject.toml's setuptools."""
    if int(version.split(".")[0]) < MIN_SETUPTOOLS:
        raise SystemExit(f"cgraph's build needs setuptools>={MIN_SETUPTOOLS}; this Python has "
                         f"{version}: pip install -U 'setuptools>={MIN_SETUPTOOLS}', "
                         "then install cgraph again.")


def _find_cuda_home():
    """torch.utils.cpp_extension needs CUDA_HOME; nvcc may be a wrapper
    script outside the toolkit, so look for the headers as well."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for path in candidates:
        if path and os.path.exists(os.path.join(path, "include", "cuda_runtime.h")):
            return path
    return None


def _shared_libstdcxx():
    """Link arguments naming the libstdc++ that torch itself runs with, when
    the C++ compiler has only a static one (seen on the GPU machine's
    /opt/gcc).  Otherwise parts of a static libstdc++ land in _C.so: two C++
    runtimes in one process, and the first number streamed into an error
    message crashes inside std::ostream."""
    cxx = shutil.which(os.environ.get("CXX", "g++")) or "g++"
    try:
        found = subprocess.run([cxx, "-print-file-name=libstdc++.so"],
                               capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return []
    if os.path.isabs(found) and os.path.exists(found):
        return []
    with open("/proc/self/maps") as maps:  # torch is imported: its libstdc++ is mapped
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libstdc++.so"):
                return [path]
    return []

def _cuda_library_includes():
    """Include folders for CUDA library headers (cusparse.h, cublas_v2.h)
    that torch's ATen/cuda headers include, where the toolkit lacks them:
    pip's CUDA wheels (nvidia/*/include), which torch itself runs with."""
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if os.path.exists(os.path.join(home, "include", "cusparse.h")):
        return []
    try:
        import nvidia
    except ImportError:
        return []
    return sorted({os.path.dirname(h) for root in nvidia.__path__
                   for h in glob.glob(os.path.join(root, "*", "include", "cusparse.h"))})


def _default_cuda_archs(torch):
    """Where no GPU is visible (CI), torch's cpp_extension finds no arch to
    build the kernels for and fails: build them for the archs torch itself
    was built for.  With a GPU, torch picks that GPU's arch."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.device_count() > 0:
        return
    try:
        flags = torch._C._cuda_getArchFlags().split()  # "sm_75 sm_80 ..."
    except (AttributeError, RuntimeError):
        flags = []
    archs = [f"{f[3:-1]}.{f[-1]}" for f in flags if f.startswith("sm_") and f[3:].isdigit()]
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs or ["8.0", "9.0"]) + "+PTX"


def _sources():
    """csrc by kind, globbed so that new files need no edit here."""
    return {
        "c": sorted(glob.glob("csrc/*.c")),
        "cxx": sorted(glob.glob("csrc/aten_*.cpp")),
        "cuda": sorted(glob.glob("csrc/*.cu")),  # kernels, compiled by nvcc
        "headers": sorted(glob.glob("csrc/*.h") + glob.glob("csrc/*.hpp") + glob.glob("csrc/*.cuh")),
    }


def _build_ext_class(BuildExtension, sources):
    """torch's BuildExtension, building the C library first."""

    class BuildWithC(BuildExtension):
        """Builds the C library first and links all of it into the extension."""

        def run(self):
            self.run_command("build_clib")
            clib = self.get_finalized_command("build_clib")
            archive = os.path.join(clib.build_clib, f"lib{C_LIBRARY}.a")
            for ext in self.extensions:
                ext.extra_link_args += ["-Wl,--whole-archive", archive, "-Wl,--no-whole-archive"]
                ext.extra_link_args += _shared_libstdcxx()
                ext.extra_link_args += [f"-Wl,--version-script={EXPORTS_MAP}"]
                ext.depends += sources["c"] + sources["headers"] + [EXPORTS_MAP]
            super().run()

    return BuildWithC


def main():
    """setuptools and torch checked first (one sentence each where they will
    not do), CUDA_HOME set before cpp_extension reads it, then setuptools."""
    check_setuptools(setuptools.__version__)
    cuda_home = _find_cuda_home()
    if cuda_home:
        os.environ["CUDA_HOME"] = cuda_home  # before cpp_extension reads it
    import torch

    check_cuda_torch(torch)
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    _default_cuda_archs(torch)
    sources = _sources()
    # Hidden visibility keeps our symbols out of the dynamic symbol table; the
    # version script also hides what torch's headers instantiate in our objects.
    hidden = ["-fvisibility=hidden"]
    setup(
        libraries=[
            (
                C_LIBRARY,
                {
                    "sources": sources["c"],
                    "include_dirs": [sysconfig.get_paths()["include"], "csrc"],
                    "cflags": ["-std=c11", "-fPIC", "-O2", "-Wall", "-Wextra", *hidden,
                               "-Wno-unused-parameter", "-Wno-missing-field-initializers"],
                },
            )
        ],
        ext_modules=[
            CUDAExtension(
                name="cgraph._C",
                sources=sources["cxx"] + sources["cuda"],
                include_dirs=[os.path.abspath("csrc"), *_cuda_library_includes()],
                # No -std: torch picks the standard its headers need (C++20 from 2.14).
                extra_compile_args={
                    "cxx": ["-O2", *hidden, "-fvisibility-inlines-hidden"],
                    "nvcc": ["-O3", "-Xcompiler=-fvisibility=hidden,-fvisibility-inlines-hidden"],
                },
            )
        ],
        cmdclass={"build_ext": _build_ext_class(BuildExtension, sources)},
    )


# setuptools' build backend runs this file as __main__ too; tests load it as a
# module to call the checks.
if __name__ == "__main__":
    main()
