"""pytest plugin (placeholder until the scenario collector lands)."""
