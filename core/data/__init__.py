"""Data as users have it, and as the trainer sees it.

* files.py and formats/: reading and checking dataset files, and the layouts they come in
  (torch-free: the API checks uploads and specs with them).
* The row pipeline the trainer and the estimate share (imports torch): datasets.py (files ->
  checked rows -> the datasets a run trains on), tokenize.py (rows -> token ids and labels),
  chat_spans.py (which tokens of a conversation are the assistant's), packing.py (several
  examples per row), collator.py (batches), preview.py (rows as rendered, before a run).
"""
