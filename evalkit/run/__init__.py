"""The run pipeline: models loaded, samples run (one prefill, every variant compressed and decoded: engine), rows
recorded as they finish (rows), a run folder's identity and resume (resume), one writer per folder (lock)."""
