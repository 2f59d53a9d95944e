"""Running a suite end to end: case by case through the launcher, records aggregated and judged,
progress on the terminal; also ``compare``, ``ab`` and the dry run.
"""
