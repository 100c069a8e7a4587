"""Hydra's config names (choices), overrides (overrides) and the gate's YAML files (gatefile), without torch:
the command lines' alone."""
