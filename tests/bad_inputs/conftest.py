"""The bad-input corpus is data for tests/test_bad_inputs.py: its scenario files are broken on
purpose, so pytest must not collect them as scenarios."""

collect_ignore_glob = ["*.toml"]
