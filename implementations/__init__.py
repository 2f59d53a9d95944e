"""Implementations behind the protocol in ``zbench.protocol``; one module (or package) each.

``BUILTIN`` maps a suite name to ``module:attribute``. A suite may also name any
other implementation by import path (``my_pkg.engine:MyZero``).
"""

BUILTIN: dict[str, str] = {
    "ddp": "implementations.ddp:IMPLEMENTATION",
    "fsdp": "implementations.fsdp:IMPLEMENTATION",
    "torch_zero": "implementations.torch_zero:IMPLEMENTATION",
    "zero1": "implementations.zero:ZERO1",
    "zero2": "implementations.zero:ZERO2",
    "zero3": "implementations.zero:ZERO3",
}
