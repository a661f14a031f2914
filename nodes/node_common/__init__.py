"""What every role on a node shares: request parsing and checks (`requests`), admission and
rate limits (`admission`), connection liveness (`liveness`) and the cluster's suffix-share
channel (`suffix_share`). Nothing here imports a role.

The roles themselves are packages beside this one: `nodes.verifier`, `nodes.proposer`,
`nodes.gateway`, `nodes.shard`; `nodes.assemble` builds the ones a node runs from its flags.
"""
