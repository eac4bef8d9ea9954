"""`--compile_for`: the run compiled ahead of time for a TPU slice, and the collectives of its program."""
