"""The run: every sample built and checked (runner), one sample loop for every engine (loop), a run folder's
identity and resume (resume), Ctrl-C between samples (interrupt)."""
