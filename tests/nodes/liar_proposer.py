"""A proposer node that lies: it joins a cluster like a real proposer (tokenizer-agnostic card)
and streams wrong draft chunks (protocol 2) in reply to every session_open, in one of several
ways (argv[2]):

  garbage        undecodable bytes on the ROUTER
  wrong_session  a well-formed draft_chunk for another session id
  other_tokenizer  draft ids from a much larger vocabulary
  wrong_position   a draft based on a committed length the verifier never sent
  flood          valid-looking chunks, thousands of them, as fast as it can
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
        if msg.type != "session_open":
            req.reply(make("done", finish_reason="ok"))
            return
        committed, sid, k = len(msg.tensors[0]), msg.session, 4
        for i in range(3 if mode != "flood" else 5000):
            if mode == "garbage":
                node.server.send(req.peer, [b"\xc1\x00 not a header", b"junk"], None)
            elif mode == "wrong_session":
                req.reply(make("draft_chunk", session="not-yours", base=committed,
                               tensors=[np.arange(k, dtype=np.int32)]), more=True)
            elif mode == "other_tokenizer":
                req.reply(make("draft_chunk", session=sid, base=committed,
                               tensors=[np.full(k, 10**6, dtype=np.int32)]), more=True)
            elif mode == "flood":
                req.reply(make("draft_chunk", session=sid, base=committed, chunk=i,
                               tensors=[np.arange(k, dtype=np.int32)]), more=True)
            else:
                req.reply(make("draft_chunk", session=sid, base=committed + 7 + i,
                               tensors=[np.arange(k, dtype=np.int32)]), more=True)

    for t in ("session_open", "session_extend", "session_close"):
        node.register_request(t, lie)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    node.start()
    print(node.server.endpoint, node.node_id, flush=True)
    stop.wait()
    node.stop()


if __name__ == "__main__":
    main()
