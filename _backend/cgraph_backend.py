"""cgraph's build backend: setuptools', with the build environment given the
torch release that cgraph will run with.

cgraph's extension is compiled against torch's C++ headers and linked against
its libraries, so it must be built against the torch release it is imported
with.  pip's isolated build (plain `pip install .`) installs the build
requirements into a fresh environment, where a static "torch>=2.11" would take
the newest torch, not the installed one, and the extension would then fail to
load or misbehave.  So pyproject.toml does not list torch; the
get_requires_for_build_* hooks here ask for the release installed where cgraph
is going (`torch==2.14.1` for an installed 2.14.1+cu130: a local label names
an index pip may not be given, and the C++ interface is the release's).  With
no torch installed there, any torch>=2.11 will do: pip installs the newest for
both.

`pip install --no-build-isolation .` skips all this and compiles against the
installed torch itself: the recommended way, and the faster one.
"""

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from setuptools.build_meta import *  # noqa: F401,F403  (the hooks not defined here)

MIN_TORCH = "torch>=2.11"
# Asks a Python where its torch is, without importing torch.
_FIND_TORCH = ("import importlib.util as u; s = u.find_spec('torch'); "
               "print(s.submodule_search_locations[0] if s else '')")


def _torch_folder():
    """The folder of the torch that the Python running pip sees, or None.

    pip runs these hooks with that Python but with its site-packages taken
    off sys.path (pip's sitecustomize, through PYTHONPATH): where torch is not
    found here, ask that Python again without pip's settings."""
    spec = importlib.util.find_spec("torch")
    if spec and spec.submodule_search_locations:
        return spec.submodule_search_locations[0]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    found = subprocess.run([sys.executable, "-c", _FIND_TORCH], env=env,
                           capture_output=True, text=True, check=False).stdout.strip()
    return found or None


def _torch_version_fields(folder):
    """__version__, cuda and hip from torch/version.py, read, not imported
    (importing torch here would load the wrong libraries or fail)."""
    fields = {}
    tree = ast.parse(Path(folder, "version.py").read_text())
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and isinstance(getattr(node, "value", None), ast.Constant):
            fields[target.id] = node.value.value
    return fields.get("__version__"), fields.get("cuda"), fields.get("hip")


def _cuda_check():
    """cgraph/_cuda_check.py, loaded by path (the package is not built yet)."""
    path = Path(__file__).resolve().parent.parent / "cgraph" / "_cuda_check.py"
    spec = importlib.util.spec_from_file_location("_cgraph_cuda_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def torch_requirement():
    """`torch==<release>` of the installed torch, or MIN_TORCH where there is
    none; stops with one sentence where the installed torch has no CUDA."""
    folder = _torch_folder()
    if folder is None or not Path(folder, "version.py").exists():
        return MIN_TORCH
    version, cuda, hip = _torch_version_fields(folder)
    if not version:
        return MIN_TORCH
    check = _cuda_check()
    problem = check.not_cuda_message(version, cuda, hip)
    if problem:
        raise SystemExit(f"{problem}. {check.HOW_TO_BUILD}")
    return f"torch=={version.split('+')[0]}"


def get_requires_for_build_wheel(config_settings=None):
    """Not setuptools' hook: that one runs setup.py, which needs torch."""
    return [torch_requirement()]


def get_requires_for_build_editable(config_settings=None):
    return [torch_requirement()]


def get_requires_for_build_sdist(config_settings=None):
    """setup.py imports torch for every command, an sdist's too."""
    return [torch_requirement()]
