"""cgraph's log: Python ``logging`` under the logger ``cgraph``.

Nothing is printed unless asked for: events are logged at INFO (or DEBUG)
and Python's default shows WARNING and above.  Switch it on as
``TORCH_LOGS`` does for torch, with an environment variable read at import:

    CGRAPH_LOGS=info python train.py    # or debug

or with ``logging.getLogger("cgraph").setLevel(logging.INFO)`` and a handler
of your own.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("cgraph")


def configure_from_environment(value: str | None = None) -> None:
    """Sets the logger's level from ``CGRAPH_LOGS`` (info, debug, warning),
    with a handler writing "[cgraph] message" to stderr; unset: nothing."""
    value = os.environ.get("CGRAPH_LOGS") if value is None else value
    if not value:
        return
    level = logging.getLevelName(value.strip().upper())
    if not isinstance(level, int):
        raise ValueError(f"CGRAPH_LOGS={value!r}: use one of debug, info, warning.")
    log.setLevel(level)
    if not any(getattr(h, "_cgraph", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[cgraph] %(message)s"))
        handler._cgraph = True
        log.addHandler(handler)


def describe(graphed) -> str:
    """'callable 0 (Linear)': how log lines name a graphed callable."""
    spec = graphed.spec
    if spec is None:
        return "a reset callable"
    target = spec.module() if spec.module is not None else spec.function
    name = type(target).__name__ if spec.module is not None else getattr(
        target, "__qualname__", type(target).__name__)
    return f"callable {spec.index} ({name})"


def on_event(event: str, graphed) -> None:
    """The native core's event hook (_C.set_event_hook)."""
    if event == "eager_pending":
        log.info(
            "%s: a call ran eagerly because the backward of its previous call has not "
            "run yet (a replay would overwrite the activations it needs); counted in "
            "stats['eager_pending']. Logged once per callable.", describe(graphed))
    else:
        log.debug("%s: %s", describe(graphed), event)
