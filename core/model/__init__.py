"""The model a job trains, as its spec describes it, before any weight is read: the PEFT
config (peft.py), whether the loss needs every position's logits (lm_head.py), and what a
run holds in memory per process (estimate.py). The trainer (core/train/model.py,
core/train/loss.py) and the estimate decide with the same functions; the policy's memory
rule (core/policy/memory.py) reads the estimate. Importable without torch."""
