"""kvchaos faults."""
