"""Importing the framework behind an adapter (`popdist.torch`, `popdist.poptorch`, ...).

The frameworks are optional: `import popdist` never imports one. An adapter imports its
framework when the adapter itself is imported, and a missing framework becomes an ImportError
that names the package and where it comes from, instead of a bare "No module named ...".
"""

from __future__ import annotations

import importlib
from types import ModuleType


def import_framework(module: str, adapter: str, install: str) -> ModuleType:
    """Import `module` for `adapter`; `install` tells the user how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        if not _is_missing(error, module):
            # The framework is there but one of *its* imports failed (a broken SDK, a
            # missing shared library): saying "install it" would send the user astray.
            raise ImportError(
                f"{adapter} could not import {module!r}, which is installed but failed to "
                f"import: {error}", name=module) from error
        raise ImportError(
            f"{adapter} needs the {module!r} package, which is not installed here: {install}",
            name=module) from error


def _is_missing(error: ImportError, module: str) -> bool:
    # `error.name` is the module that could not be found: the framework itself or one of
    # its parent packages (`tensorflow` for `tensorflow.python.ipu`). A None entry in
    # sys.modules (an import deliberately blocked) raises with the same name.
    return error.name is not None and (module == error.name
                                       or module.startswith(error.name + "."))
