"""The proposer role: draft sessions for remote verifiers."""
