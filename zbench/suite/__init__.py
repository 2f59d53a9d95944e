"""From a suite file to the cases a run will launch: parsing and validation, DeepSpeed configs,
selection, and the pre-flight checks.
"""
