"""The cluster client: one generation policy (verifier choice, liveness, stall detection,
failover) with a sync face and an async face.

- core.py: `Failover`, the state machine that decides everything and does no I/O;
- choice.py: `Balancer` (least loaded with room), `verifier_gone` (the liveness rule);
- sync.py: `ClusterClient`, an observer node (`specbus generate --cluster`, the demo, benches);
- aio.py: `events()`, the same core on an asyncio loop (the gateway's handlers);
- request.py: `GenerateRequest`, a builder of the wire's `GenerateReq`;
- text.py: `TextAssembler`, the text a client may show (stop strings, half characters).
"""

from nodes.cluster_client.choice import verifier_gone
from nodes.cluster_client.failover import LOST, ClusterError
from nodes.cluster_client.request import GenerateRequest
from nodes.cluster_client.sync import ClusterClient, Result

__all__ = ["LOST", "ClusterClient", "ClusterError", "GenerateRequest", "Result",
           "verifier_gone"]
