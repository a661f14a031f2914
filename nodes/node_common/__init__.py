"""What every role on a node shares: request parsing and checks (`requests`), admission and
rate limits (`admission`), connection liveness (`liveness`), the cluster's suffix-share channel
(`suffix_share`) and building the roles a node runs (`assemble`).

The roles themselves are packages beside this one: `nodes.verifier`, `nodes.proposer`,
`nodes.gateway`, `nodes.shard`.
"""
