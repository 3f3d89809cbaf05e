"""Tensor parallelism plumbing: process groups, the step-plan wire format, rank lifelines."""
