"""`specbus bench NAME`: benchmarks that print a table and optionally write JSON.

Each benchmark is its own module; the CLI dispatches through `SUBCOMMANDS`.
"""

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "bus": ("tools.bench_bus", "bus latency, throughput and zero-copy between two processes"),
    "membership": ("tools.bench_membership", "join, failure detection, leave, convergence"),
    "forward": ("tools.bench_forward", "a verify forward's cost by tokens fed, torch vs few-row"),
    "vs-llamacpp": ("tools.bench_vs_llamacpp",
                    "the quantized verifier against llama.cpp's llama-bench, same file and core"),
    "decode": ("tools.bench_decode", "plain vs speculative decoding, tok/s and acceptance"),
    "serve": ("tools.bench_serve", "TTFT and tok/s through the gateway vs the bus client"),
    "prefix": ("tools.bench_prefix", "a conversation's TTFT per turn, prefix cache on vs off"),
    "flood": ("tools.bench_suffix_flood", "a suffix proposer fed GiBs of hostile publications"),
    "shard": ("tools.bench_shard", "a verifier sharded into 1-3 pipeline stages: RSS, tok/s"),
    "structured": ("tools.bench_structured", "constrained plain vs speculative, tool calls"),
    "memory": ("tools.bench_memory", "K/V bytes, RSS and decode tok/s at 1k-16k, bounded vs full"),
}
