"""Hydra's config names (choices) and overrides (overrides), without torch: the command lines' and the planner's."""
