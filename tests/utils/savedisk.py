"""A directory in the layout ``datasets.Dataset.save_to_disk`` writes, built with pyarrow
alone (``datasets`` is not a dependency): Arrow IPC *stream* shards named
data-XXXXX-of-YYYYY.arrow, listed in state.json's ``_data_files``, beside dataset_info.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def save_to_disk(path: Path, rows: list[dict[str, Any]], shards: int = 1) -> Path:
    import pyarrow as pa

    path.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    per = -(-len(rows) // shards)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    for i, name in enumerate(names):
        with (
            pa.OSFile(str(path / name), "wb") as sink,
            pa.ipc.new_stream(sink, table.schema) as writer,
        ):
            for batch in table.slice(i * per, per).to_batches(max_chunksize=2):
                writer.write_batch(batch)
    state = {
        "_data_files": [{"filename": n} for n in names],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (path / "state.json").write_text(json.dumps(state, indent=2))
    info = {"description": "", "features": {}, "splits": None, "version": None}
    (path / "dataset_info.json").write_text(json.dumps(info, indent=2))
    return path
