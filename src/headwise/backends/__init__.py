"""The runners behind ``headwise.attention``, each ``fn(q, k, v, spec) -> context``, and ``plan``, the one
table that picks one for a call (ARCHITECTURE.md lists the files). No runner drops a term."""
