"""Traces at any scale: an implementation's real code run on fake tensors in a fake process group (``zbench plan --trace``)."""
