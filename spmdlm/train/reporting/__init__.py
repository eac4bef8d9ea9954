"""What a run shows and leaves behind: the metrics log, the progress display, the trackers, goodput, the profiler."""
