"""Graders at run time: scoring answers for GRPO and evals (run.py), the python sandbox
(sandbox.py), the judge endpoint (judge.py), text metrics (text.py), what the operator allows
(config.py), and the checks of a dataset's rows and of a job's graders against this server.
What a grader *is* (OpenAI's shapes, templates, formulas, their checks) is part of the spec:
core/spec/graders.py."""
