"""Training and evaluating EAGLE-3 draft heads (`specbus train-drafter`, `python -m
nodes.training.evaluate`); the runtime head lives in `nodes.drafters.eagle`."""
