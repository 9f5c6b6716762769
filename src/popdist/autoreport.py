"""Per-instance profiling directories for `poprun --autoreport-dir DIR` (guide §2.7).

poprun passes DIR to every instance as POPDIST_AUTOREPORT_DIRECTORY; here each instance turns
it into its own `autoReport.directory` = DIR/<instance index> in POPLAR_ENGINE_OPTIONS (so the
instances' reports never overwrite each other), and switches `autoReport.all` on when no
profiling setting is there yet. `{"autoReport.all": "false"}` keeps profiling off: then no
directory is set, and Poplar creates none.
"""

from __future__ import annotations

import json
import os
from collections.abc import MutableMapping
from typing import Any

from popdist import env


def setEngineOptions(options: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Apply --autoreport-dir to a Poplar engine option dict (as popdist::setEngineOptions
    does for poplar::OptionFlags); returns it. Unchanged outside such a launch."""
    directory = os.environ.get(env.AUTOREPORT_DIRECTORY)
    if not directory:
        return options
    if str(options.get("autoReport.all", "")).lower() == "false":
        return options  # profiling explicitly off: no directory
    if not any(key.startswith("autoReport.") for key in options):
        options["autoReport.all"] = "true"
    index = env.read_int(os.environ, env.REPLICA_INDEX_OFFSET, 0) // max(
        env.read_int(os.environ, env.NUM_LOCAL_REPLICAS, 1), 1)
    options["autoReport.directory"] = os.path.join(directory, str(index))
    return options


def apply_to_environment(environ: MutableMapping[str, str] = os.environ) -> None:
    """Rewrite POPLAR_ENGINE_OPTIONS in `environ` by the rules above. Invalid JSON there is
    left alone: Poplar itself will report it, with its own context."""
    if not environ.get(env.AUTOREPORT_DIRECTORY):
        return
    text = environ.get(env.POPLAR_ENGINE_OPTIONS) or "{}"
    try:
        options = json.loads(text)
    except json.JSONDecodeError:
        return
    if isinstance(options, dict):
        environ[env.POPLAR_ENGINE_OPTIONS] = json.dumps(setEngineOptions(options))
