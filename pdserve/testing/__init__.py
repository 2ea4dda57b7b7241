"""Drivers for pdserve's tests and benchmarks; nothing in the product imports this package."""
