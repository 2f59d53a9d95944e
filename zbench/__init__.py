"""zbench: benchmark and regression harness for ZeRO implementations."""

__version__ = "0.1.0"
