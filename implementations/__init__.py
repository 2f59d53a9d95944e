"""Implementations behind the protocol in ``zbench.protocol``; one module (or package) each.

``BUILTIN`` maps a suite name to ``module:attribute``. A suite may also name any
other implementation by import path (``my_pkg.engine:MyZero``).
"""

BUILTIN: dict[str, str] = {
    "ddp": "zbench.implementations.ddp:IMPLEMENTATION",
    "deepspeed": "zbench.implementations.deepspeed_zero:IMPLEMENTATION",
    "fsdp": "zbench.implementations.fsdp:IMPLEMENTATION",
    "fsdp1": "zbench.implementations.fsdp1:IMPLEMENTATION",
    "torch_zero": "zbench.implementations.torch_zero:IMPLEMENTATION",
    "zero1": "zbench.implementations.zero:ZERO1",
    "zero2": "zbench.implementations.zero:ZERO2",
    "zero3": "zbench.implementations.zero:ZERO3",
}
