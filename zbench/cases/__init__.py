"""What one case is made of: the case itself, its model and data, the implementation it runs, and the
bytes the ZeRO formulas expect it to hold.
"""
