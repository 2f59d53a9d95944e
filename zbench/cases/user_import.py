"""Import a user's plug-in module (an implementation, a model builder) the way the ranks will find it."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType


def import_user_module(module_name: str) -> ModuleType:
    """Installed, on ``PYTHONPATH``, or in the working directory (the launcher puts it on the ranks' path too)."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
    return importlib.import_module(module_name)
