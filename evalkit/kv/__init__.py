"""KV storage and attention: caches that hold a policy's choice (cache), quantized storage (quantized), what
attention is observed for the policies (attention), and the policy contract checked at every eviction (contract)."""
