"""Node roles: what a node does with the bus once it has joined (verifier, proposer)."""
