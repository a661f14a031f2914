"""A verifier sharded across hosts: a pipeline of stages over torch.distributed (issue 13)."""
