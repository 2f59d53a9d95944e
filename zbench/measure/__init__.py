"""Instruments: timing, memory and model-state accounting. None of them lives inside an implementation."""
