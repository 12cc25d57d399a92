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

Build time: parsing torch's headers and compiling what they
inline dominates, and every csrc/aten_*.cpp pays it again.  So the C++ files
are compiled in a few unity translation units (build/unity/*.cpp, generated
here, each #including some csrc/aten_*.cpp): as many as compiles run at once
(MAX_JOBS, else the CPUs; one without ninja, which compiles one at a time),
never more than the files.  On 2 cores that is 2 units, and the in-place build
went from 207 s to 37-41 s (292 s to 47 s without ninja); on 16 cores every
file is its own unit, as before.  CGRAPH_UNITY=0 compiles file by file (what an edit-compile loop on
few cores may prefer: an edit then recompiles one file, not its whole unit),
CGRAPH_UNITY=N in N units.  Files of one unit share one translation unit: two
of them must not define the same name in an anonymous namespace or as static.
"""
import glob
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import typing

import setuptools
from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
C_LIBRARY = "cgraph_c"
MIN_SETUPTOOLS = 77  # as pyproject.toml's build-system requires
# Linked in with --version-script: the module exports PyInit__C and nothing else.
EXPORTS_MAP = os.path.join(HERE, "csrc", "exports.map")
# The unity translation units: generated at build time, not named in setup()
# (setuptools would put them in the sdist).
UNITY_DIR = os.path.join("build", "unity")


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


def _version_number(text):
    """"12.4" (torch.version.cuda) as CUDA_VERSION writes it, 12040."""
    major, minor = (int(part) for part in text.split(".")[:2])
    return major * 1000 + minor * 10


class CudaHeader(typing.NamedTuple):
    """The cuda.h the compiler reads, and the CUDA_VERSION it defines (13000
    for CUDA 13.0; None where it defines none)."""

    path: str
    version: typing.Optional[int]


def first_cuda_header(include_dirs):
    """The first cuda.h in `include_dirs`, the folders the compiler searches
    in that order (pip's CUDA wheels, _cuda_library_includes, before
    CUDA_HOME's include: each may have its own cuda.h), or None."""
    for folder in include_dirs:
        path = os.path.join(folder, "cuda.h")
        if not os.path.exists(path):
            continue
        version = None
        try:
            with open(path) as header:
                version = next((int(line.split()[2]) for line in header
                                if line.startswith("#define CUDA_VERSION ")), None)
        except (OSError, ValueError, IndexError):
            pass
        return CudaHeader(path, version)
    return None


def compiled_cuda_header(cuda_home, library_includes):
    """The cuda.h the build compiles with: CUDAExtension searches our
    include folders (csrc, then `library_includes`, pip's CUDA wheels:
    _cuda_library_includes) before torch's and CUDA_HOME's include."""
    home = [os.path.join(cuda_home, "include")] if cuda_home else []
    return first_cuda_header([*library_includes, *home])


def check_cuda_toolkit(torch_cuda, toolkit, graph_header):
    """Stop the build where the CUDA the compiler reads (`toolkit`, a
    CudaHeader or None) is older than 12.4 and torch's CUDA is 12.4 or
    newer, if torch's at::cuda::CUDAGraph has members only under
    CUDA_VERSION >= 12040 (torch 2.12 on: conditional nodes' stacks).  The
    header takes CUDA_VERSION from the cuda.h compiling cgraph, not from
    torch's build: cgraph's Graph, a subclass, would be laid out 320 bytes
    short of the object torch's constructor and destructor write (heap
    corruption).  `graph_header` is CUDAGraph.h's text."""
    version = toolkit.version if toolkit is not None else None
    if version is None or torch_cuda is None or version >= 12040:
        return
    if _version_number(torch_cuda) < 12040 or "CUDA_VERSION >= 12040" not in graph_header:
        return
    raise SystemExit(
        f"cgraph's build found CUDA {version // 1000}.{version % 1000 // 10} ({toolkit.path}), "
        f"older than this torch's CUDA {torch_cuda}: torch's CUDAGraph class would compile to "
        "another size here than in torch. Install a CUDA toolkit of 12.4 or newer (best: "
        f"{torch_cuda}) and point CUDA_HOME at it, then install cgraph again.")


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
    was built for (machine code for each, so no driver has to compile PTX,
    and PTX for the newest, for GPUs newer still).  With a GPU, torch picks
    that GPU's arch.  The kernels are one small file: nvcc takes 5.5 s for
    torch 2.14's seven targets against 1.6 s for one, beside the C++ half."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.device_count() > 0:
        return
    try:
        flags = torch._C._cuda_getArchFlags().split()  # "sm_75 sm_80 ..."
    except (AttributeError, RuntimeError):
        flags = []
    archs = [f"{f[3:-1]}.{f[-1]}" for f in flags if f.startswith("sm_") and f[3:].isdigit()]
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs or ["8.0", "9.0"]) + "+PTX"


def _ninja_on_path():
    """torch's BuildExtension compiles in parallel with ninja where `ninja`
    runs, else one file at a time.  pip's ninja package (scripts/_deps.sh
    installs it where there is none) puts it in its Python's bin folder,
    which is not always on PATH: add that folder.  Not a build requirement in
    pyproject.toml: `python -m build --no-isolation` would then refuse a
    machine with only Debian's ninja, and the unity build needs no ninja to
    be quick (one unit, 47 s on 2 cores)."""
    if shutil.which("ninja"):
        return True
    try:
        import ninja
    except ImportError:
        return False
    folder = getattr(ninja, "BIN_DIR", None)
    if folder and os.path.exists(os.path.join(folder, "ninja")):
        os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")
        return True
    return False


def _parallel_jobs():
    """How many compiles run at once: MAX_JOBS, as torch's cpp_extension reads
    it, else the CPUs this process may run on."""
    jobs = os.environ.get("MAX_JOBS", "")
    if jobs.isdigit() and int(jobs) > 0:
        return int(jobs)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def unity_count(files, jobs, ninja):
    """How many translation units the C++ files are compiled in: CGRAPH_UNITY
    where set (0: each file its own), else one a parallel job (one in all
    without ninja), never more than the files."""
    asked = os.environ.get("CGRAPH_UNITY", "").strip().lower()
    if asked in ("0", "off", "no", "false"):
        return len(files)
    if asked.isdigit():
        wanted = int(asked)
    else:
        wanted = jobs if ninja else 1
    return max(1, min(wanted, len(files)))


def unity_groups(files, count, weight=os.path.getsize):
    """`files` in `count` groups of about equal weight (the biggest first, each
    to the lightest group so far), each group in name order."""
    groups = [[] for _ in range(count)]
    loads = [0] * count
    for path in sorted(files, key=lambda f: (-weight(f), f)):
        lightest = loads.index(min(loads))
        groups[lightest].append(path)
        loads[lightest] += weight(path)
    return sorted((sorted(g) for g in groups if g), key=lambda g: g[0])


def _write_if_changed(path, text):
    """Rewrites only a changed file: ninja and setuptools go by timestamps."""
    try:
        with open(path) as f:
            if f.read() == text:
                return
    except OSError:
        pass
    with open(path, "w") as f:
        f.write(text)


def unity_sources(files, count, folder=UNITY_DIR):
    """The sources to compile for `files`: a group of one is that file, a
    bigger group a generated build/unity/aten_unity_<i>.cpp that #includes
    its files (by absolute path: the folder's depth does not matter)."""
    sources, wanted = [], set()
    for i, group in enumerate(unity_groups(files, count)):
        if len(group) == 1:
            sources.append(group[0])
            continue
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"aten_unity_{i}.cpp")
        lines = ["// Generated by setup.py: one translation unit for these files (a unity build,",
                 "// see setup.py).  Edit the files, not this.  CGRAPH_UNITY=0 builds them one by one."]
        lines += [f'#include "{os.path.abspath(f)}"' for f in group]
        _write_if_changed(path, "\n".join(lines) + "\n")
        sources.append(path)
        wanted.add(os.path.basename(path))
    for stale in glob.glob(os.path.join(folder, "aten_unity_*.cpp")):
        if os.path.basename(stale) not in wanted:
            os.remove(stale)
    return sources


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
            ninja = self.use_ninja  # BuildExtension's: False where ninja does not run
            count = unity_count(sources["cxx"], _parallel_jobs(), ninja)
            self.run_command("build_clib")
            clib = self.get_finalized_command("build_clib")
            archive = os.path.join(clib.build_clib, f"lib{C_LIBRARY}.a")
            for ext in self.extensions:
                ext.extra_link_args += ["-Wl,--whole-archive", archive, "-Wl,--no-whole-archive"]
                ext.extra_link_args += _shared_libstdcxx()
                ext.extra_link_args += [f"-Wl,--version-script={EXPORTS_MAP}"]
                ext.depends += sources["c"] + sources["headers"] + [EXPORTS_MAP]
                # The C++ files, one translation unit per group; they stay
                # dependencies for setuptools' is-it-up-to-date check.
                ext.sources = [s for s in ext.sources if s not in sources["cxx"]]
                ext.sources = unity_sources(sources["cxx"], count) + ext.sources
                ext.depends += sources["cxx"]
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
    # Reads CUDA_HOME, set above, or finds one itself (an nvcc on PATH).
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

    library_includes = _cuda_library_includes()
    graph_header = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "cuda",
                                "CUDAGraph.h")
    with open(graph_header) as header:
        check_cuda_toolkit(torch.version.cuda,
                           compiled_cuda_header(cuda_home or CUDA_HOME, library_includes),
                           header.read())
    _ninja_on_path()  # before BuildExtension looks for it

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
                include_dirs=[os.path.abspath("csrc"), *library_includes],
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
