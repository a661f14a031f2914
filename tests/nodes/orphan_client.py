"""A cluster client in its own process that queues N generations on one verifier, then either
hangs until it is killed (`hang`) or leaves normally with its calls still in flight (`exit`).

Usage: orphan_client.py CLUSTER SEED_ENDPOINT N MAX_TOKENS hang|exit
Prints `ready NODE_ID` once its first generation streams (the others are queued behind it).
"""

import sys
import time

from nodes.cluster_client import ClusterClient, GenerateRequest


def main() -> None:
    cluster, seed, n, max_tokens, mode = sys.argv[1:6]
    with ClusterClient(cluster, peers=(seed,), mdns=False) as cc:
        verifier = cc.verifiers(60)[0]
        endpoint = verifier.card.endpoints["stream"]
        req = GenerateRequest("Write a long story about a lighthouse keeper and the sea.",
                              max_tokens=int(max_tokens), speculate=False)
        calls = [cc.node.client.request(endpoint, req.to_message()) for _ in range(int(n))]
        calls[0].next(timeout=120)  # the first one runs: the others wait in the queue
        print("ready", cc.node.node_id, flush=True)
        if mode == "hang":
            time.sleep(600)
    # mode "exit": the with-block closed the client with every call still in flight


if __name__ == "__main__":
    main()
