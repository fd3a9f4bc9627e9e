"""kvchaos harness."""
