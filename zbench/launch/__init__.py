"""Starting a case's ranks and collecting what they hand back: torch's elastic agent, several nodes,
SLURM, the hand-off files.
"""
