"""The command line and its config: the only layer that knows Hydra. `python -m evalkit` composes a run's config,
checks it before anything heavy loads (precheck, config), runs it (evalkit.run), gates it (evalkit.gate) and exits
with the contract's code; sweeps end in one merged report and gate (sweep)."""
