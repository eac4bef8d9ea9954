"""What keeps a run safe: the output dir's lock and the stop signals (guard), the hang watchdog."""
