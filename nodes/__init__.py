"""The specbus node: roles, backends, drafters, the speculative-decoding engine and the CLI."""
