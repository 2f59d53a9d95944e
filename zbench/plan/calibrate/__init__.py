"""``zbench calibrate``: measure the machine at hand and write a cluster profile the simulator reads."""
