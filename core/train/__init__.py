"""The trainer: ``accelerate launch --config_file <job_dir>/accelerate.yaml -m core.train <job_dir>``
(or ``python -m core.train <job_dir>`` for one process).

A pure program over the job directory (core/run/jobdir.py): reads spec.json; writes
events.jsonl (rank 0), checkpoints/checkpoint-<step>/, adapter/, merged/ (only with
training.export_merged) and, on failure, error.json.
Exit status: 0 finished or stopped gracefully, 1 failed (error.json says why), 2 bad usage.

Modules, in the order a run uses them:
  __main__   argv, signal handler, exception -> error.json + exit code
  job        spec.json -> JobSpec + Runtime; checks that need no torch
  recipe     setup -> train -> save -> verify (-> merge)
  data       rows -> token ids + labels per task/format; the padding collator
  packing    several examples per row without cross-example attention
  model      tokenizer, base model, PEFT config
  trainer    Trainer subclass (NaN flag, class weights, packed inputs, generation eval)
  evaluation accuracy / macro-F1; classification by generation for small label sets
  callbacks  events during training, graceful stop, NaN guard, early stopping
  stop       StopRequest: SIGTERM / STOP file / deadline (stdlib only, installed first)
  lifeline   a rank whose parent died stops, then exits (stdlib only, started first)
  adapter    consolidated save, verification, model card, atomic publish
  merge      base + adapter merged into plain weights (rank 0, a separate step)
  failures   exception -> ErrorCode with a message a user can act on
  events     events.jsonl writer (rank 0) and per-phase memory accounting
  dist       the few collectives the recipe needs itself

Never imports the web, queue or database layers (tests/core/train/test_import_boundary.py).
"""
