"""KV storage: caches that hold a policy's choice (cache), quantized storage (quantized), a variant (variant), and the
policy contract checked at every eviction (contract)."""
