"""Things that attach to the bus from outside: monitor, benchmarks, load generator."""
