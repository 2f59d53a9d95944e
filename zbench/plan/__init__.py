"""Answers before running: memory from the ZeRO formulas (``memory``), the implementations' real code
traced on fake tensors (``trace``), and step times simulated from a trace (``simulate``).
"""
