"""What runs inside every rank of a case: build, train, measure, and the paired timing against a DDP copy."""
