"""The learning-rate schedules of --lr_scheduler_type, one module each (`SCHEDULE`), found by
spmdlm/optimizers/__init__.py."""
