"""The standing benchmarks; `dsv4 bench NAME` runs those behind the CLI (cli/dsv4_cli/bench.py)."""
