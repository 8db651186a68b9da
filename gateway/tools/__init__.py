"""Tools around the gateway: a backend simulator, a load generator and a log analyzer.

Each is a package with its own `add_arguments`/`main`, which `gateway/cli.py`
mounts as a subcommand (`simulate`, `loadgen`, `analyze`); `stats` holds the
percentile definition the load generator, the analyzer and the benchmarks share.
"""
