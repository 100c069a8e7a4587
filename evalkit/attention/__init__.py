"""Attention as the policies observe it, below the policies: the registered SDPA (sdpa.py), the output and H2O's
mass from one softmax (fused.py), and the protocol through which the engine records what a policy declares it
needs (observation.py)."""
