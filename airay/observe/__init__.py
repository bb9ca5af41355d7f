"""What a run shows of itself: the console (observe.console) and experiment tracking."""
