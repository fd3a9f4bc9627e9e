"""kvchaos command line."""
def main(argv=None):
    raise SystemExit("kvchaos: the CLI is being built")
