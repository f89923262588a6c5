"""Speculative decoding: the proposers (prompt lookup, a draft model) and the rejection sampler that keeps the target model's distribution."""
