"""Reports: read a run's results and history, never run anything."""
