"""cgraph's version, written only here: pyproject.toml's dynamic version reads
it (statically, without importing cgraph) and cgraph/__init__.py exports it."""

__version__ = "0.1.0"
