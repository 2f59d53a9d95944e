"""Step time at scale from traced collectives and a cluster profile (``zbench plan --simulate``)."""
