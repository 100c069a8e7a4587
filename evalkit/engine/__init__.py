"""evalkit's own engine (`backend=hf`): the model loaded (models), a context prefilled once and compressed for every
variant (engine), the baseline and the variants decoded in one batch (decode, outcome), what a decode held and said
as row fields (rows), and the engine as the run's sample loop drives it (hf)."""
