"""Judgements on stored results: equivalence with DDP, the regression gate between runs, and the
``zbench check`` command's logic.
"""
