"""Traces at any scale: implementations' real code on fake tensors in a fake process group (``zbench plan --trace``)."""
