"""The harness: what the benchmarks and the tests drive dsv4 with (see bench/__init__.py)."""
