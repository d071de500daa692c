"""The runners behind ``headwise.attention``: each takes (q, k, v, spec) and returns the context.

``spec.Spec`` holds the call's terms unfolded; ``math`` writes every score out (the reference
for every term); ``sdpa`` runs torch's fused kernels and carries what they can take exactly
(sinks through the log-sum-exp, ALiBi as a per-block bias), handing softcap to ``softcap``
(blocks of queries, recomputed in backward); ``packed`` cuts packed rows into their documents. No runner drops a term: what a fast
one cannot carry goes to the next best.
"""
