"""The command lines' rule for an error the user can act on (a damaged or missing checkpoint, a
config or data file that does not fit, a full disk): one line on stderr naming the thing, exit 2.
Such errors are OSErrors and ValueErrors (CheckpointError, ConfigError, DataError, MeshError ...)."""

from __future__ import annotations

import logging
import re
import sys

_TS_SPEC = re.compile(r"\s*\[tensorstore_spec='.*'\]", re.S)  # TensorStore appends its whole spec as JSON


def fail(e: Exception, path: str | None = None) -> int:
    """Prints `e` as one line (an OSError that names no file, such as a full disk's, gets `path`);
    returns the exit code 2."""
    text = f"{path}: {e.strerror or e}" if isinstance(e, OSError) and e.filename is None and path else str(e)
    print(f"error: {_TS_SPEC.sub('', text)}".replace("\n", " "), file=sys.stderr, flush=True)
    # The reads abandoned with the failed one (Orbax's other coroutines over a damaged file) would
    # print their own tracebacks at exit, as "Exception ignored" (unraisable) or as asyncio's "Task
    # exception was never retrieved" (its logger): the error above already says it.
    sys.unraisablehook = lambda unraisable: None
    logging.getLogger("asyncio").disabled = True
    return 2
