"""The stages of a run (spmdlm/train/run.py lists them in order): each takes the records and argument sections it
needs and returns a frozen record."""
