"""The learner files are inputs to grade, not test modules: pytest (and its doctest collector) leaves them alone."""

collect_ignore_glob = ["learners/*"]
