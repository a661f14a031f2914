"""EAGLE-3 draft heads that read the verifier's hidden states.

`config` (config.json), `checkpoint` (load/validate/save the published safetensors layout),
`head` (the module: fc fusion, one decoder layer, draft-vocabulary LM head), `cache` (its own
small KV cache), `tree` (EAGLE-2-style draft trees), `source` (the engine's `DraftSource` and
the `Drafter`). Training a head for a verifier (`specbus train-drafter`) is `nodes.training`.
"""
