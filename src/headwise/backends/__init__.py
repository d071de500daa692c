"""The runners behind ``headwise.attention``: each takes (q, k, v, spec) and returns the context.

``spec.Spec`` holds the call's terms unfolded; ``plan`` holds the one ordered table of rules that
picks a runner for a call (and says why); ``blocks`` is the one loop over blocks of queries.
``math`` writes every score out (the reference for every term); ``sdpa`` runs torch's fused
kernels and carries what they can take exactly (sinks through the log-sum-exp, ALiBi as a
per-block bias); ``softcap`` caps scores a block of queries at a time (recomputed in
backward); ``packed`` runs packed rows one document at a time. No runner drops a term: what a
fast one cannot carry, the plan sends to the next best.
"""
