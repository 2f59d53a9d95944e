"""What a run leaves on disk: typed records, the run header, atomic storage and loaders, pruning,
export, and how figures read.
"""
