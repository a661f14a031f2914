"""The verifier role: runs the engine for generate requests, drafts from its own drafter or
remote proposers (`proposer_client`)."""
