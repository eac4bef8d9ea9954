"""The engine: the compiled program a run and every reader of its checkpoints share (train state, the train and eval
steps, the optimizer, the layer plan), below the run (spmdlm/train) that drives it."""
