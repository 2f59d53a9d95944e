"""``zbench tune``: every setup a model could be trained with on a cluster, traced from the implementations' real
code, pruned by memory and ranked by the simulator's predicted tokens/s per GPU.

``space`` lists the setups, ``cache`` keeps each setup's trace on disk, ``search`` prunes and ranks them.
"""
