"""The verdict, with no torch: records read and cross-checked (reading, evidence), summarized (summary), judged
(stats, decide and the modules they use; judge) and written (outputs); `python -m evalkit.gate` (command)."""
