"""kvchaos scenarios."""
