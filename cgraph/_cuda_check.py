"""Whether a torch can run cgraph, judged from torch.version's fields alone.

The build (setup.py and the build backend in _backend/) and `import cgraph`
refuse a torch without CUDA with the same sentence.  Without this, the build
fails with torch's "CUDA_HOME environment variable is not set" (torch ignores
nvcc when it has no CUDA itself), and a cgraph built against another torch
fails at import with "libc10_cuda.so: cannot open shared object file".

Standard library only: setup.py and the backend load this file by path, where
cgraph itself cannot be imported.
"""

HOW_TO_BUILD = ("Install a CUDA build of torch into this Python "
                "(https://pytorch.org/get-started/locally/), then install cgraph again.")
HOW_TO_IMPORT = ("Install a CUDA build of torch (https://pytorch.org/get-started/locally/), "
                 "then rebuild cgraph against it: pip install --no-build-isolation "
                 "<cgraph's source folder or sdist>.")


def not_cuda_message(version, cuda, hip=None):
    """The sentence for a torch that is not a CUDA build (torch.version.cuda
    is None: a CPU-only or a ROCm build); None for a CUDA build."""
    if cuda:
        return None
    kind = f"a ROCm build (HIP {hip})" if hip else "CPU-only"
    return f"cgraph needs a CUDA build of PyTorch; this torch is {kind}: {version}"


def require_cuda_torch(torch, error=ImportError, advice=HOW_TO_IMPORT):
    """Raise `error` with the sentence and what to do, where `torch` (the
    module, or a stand-in with __version__ and version) is not a CUDA build."""
    version = torch.version
    problem = not_cuda_message(torch.__version__, version.cuda, getattr(version, "hip", None))
    if problem:
        raise error(f"{problem}. {advice}")
