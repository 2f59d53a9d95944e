"""Find an implementation by built-in name or by ``module:attribute`` import path."""

from __future__ import annotations

from zbench.cases.user_import import import_user_module
from zbench.implementations import BUILTIN
from zbench.protocol import Implementation


def is_import_path(name: str) -> bool:
    return ":" in name


def resolve(name: str) -> Implementation:
    """The implementation object ``name`` refers to.

    Raises ``LookupError`` with a message that lists what is allowed.
    """
    target = BUILTIN.get(name, name if is_import_path(name) else None)
    if target is None:
        raise LookupError(
            f"unknown implementation {name!r}; built-in: {', '.join(BUILTIN)}; "
            "or give an import path like 'my_pkg.engine:MyZero'"
        )
    module_name, _, attr = target.partition(":")
    try:
        module = import_user_module(module_name)
        obj = getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise LookupError(f"cannot import implementation {name!r} ({target}): {exc}") from None
    obj = obj() if isinstance(obj, type) else obj
    missing = [a for a in ("name", "capabilities", "build", "expected_comm_elements") if not hasattr(obj, a)]
    if missing:
        raise LookupError(
            f"implementation {name!r} ({target}) has no {', '.join(map(repr, missing))}; "
            "see zbench.protocol.Implementation (zbench.protocol.ImplementationBase supplies "
            "expected_comm_elements)"
        )
    return obj  # checked member by member above
