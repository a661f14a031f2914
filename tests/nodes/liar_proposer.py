"""A proposer node that lies: it joins a cluster like a real proposer (tokenizer-agnostic card)
and answers every draft request wrongly, in one of several ways (argv[2]):

  garbage        undecodable bytes on the ROUTER
  wrong_session  a well-formed draft_reply for another session id
  other_tokenizer  draft ids from a much larger vocabulary
  wrong_position   a draft continuing another committed length
"""

import signal
import sys
import threading

import numpy as np

from codec.messages import make
from nodes.node import Node, NodeConfig, parse_peer


def main() -> None:
    cluster, mode, seed = sys.argv[1], sys.argv[2], sys.argv[3]
    node = Node(NodeConfig(cluster=cluster, roles=("proposer",), name=f"liar-{mode}",
                           peers=(parse_peer(seed),), mdns=False,
                           card_fields={"tokenizer": "any", "backend": "none"}))

    def lie(req):
        msg = req.message
        if msg.type != "draft_req":
            req.reply(make("done", finish_reason="ok"))
            return
        committed, k = msg["committed"], max(1, msg["k"])
        if mode == "garbage":
            node.server.send(req.peer, [b"\xc1\x00 not a header", b"junk"], req)
            req.finished = True
        elif mode == "wrong_session":
            req.reply(make("draft_reply", session="not-yours", committed=committed,
                           tensors=[np.arange(k, dtype=np.int32)]))
        elif mode == "other_tokenizer":
            req.reply(make("draft_reply", committed=committed,
                           tensors=[np.full(k, 10**6, dtype=np.int32)]))
        else:
            req.reply(make("draft_reply", committed=committed + 7,
                           tensors=[np.arange(k, dtype=np.int32)]))

    for t in ("session_open", "session_extend", "draft_req", "session_close"):
        node.register_request(t, lie)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    node.start()
    print(node.server.endpoint, node.node_id, flush=True)
    stop.wait()
    node.stop()


if __name__ == "__main__":
    main()
