"""POST/GET/DELETE /v1/files."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from collections.abc import Iterator

import httpx
import pyarrow as pa
import pyarrow.parquet as pq

from tests.utils.api import TEXT_ROWS, Api, job_body, jsonl, upload, upload_rows


def test_upload_jsonl_counts_rows_and_columns(api: Api, client_a: httpx.Client) -> None:
    content = jsonl([{"text": "a", "label": "x"}, {"text": "b", "extra": 1}])
    r = upload(client_a, "train.jsonl", content)
    assert r.status_code == 201, r.text
    f = r.json()
    assert f["id"].startswith("file-")
    assert (f["format"], f["rows"], f["columns"]) == ("jsonl", 2, ["text", "label", "extra"])
    assert f["bytes"] == len(content) and f["sha256"] == hashlib.sha256(content).hexdigest()
    assert f["filename"] == "train.jsonl"
    assert client_a.get(f"/v1/files/{f['id']}").json() == f


def test_upload_csv_counts_rows_and_columns(client_a: httpx.Client) -> None:
    r = upload(client_a, "data.csv", b"prompt,completion\nhi,there\nyes,no\nup,down\n")
    assert r.status_code == 201, r.text
    f = r.json()
    assert (f["format"], f["rows"], f["columns"]) == ("csv", 3, ["prompt", "completion"])


def test_upload_parquet_counts_rows_and_columns(client_a: httpx.Client) -> None:
    buf = io.BytesIO()
    pq.write_table(pa.table({"input": ["a", "b", "c", "d"], "target": ["w", "x", "y", "z"]}), buf)
    r = upload(client_a, "d.parquet", buf.getvalue())
    assert r.status_code == 201, r.text
    f = r.json()
    assert (f["format"], f["rows"], f["columns"]) == ("parquet", 4, ["input", "target"])


def test_upload_too_large_is_413_and_nothing_kept(api: Api, client_a: httpx.Client) -> None:
    big = jsonl([{"text": "x" * 1000} for _ in range(80)])  # > 64 KiB limit, < limit + slack
    assert len(big) > api.settings.max_upload_bytes
    before = set(api.settings.uploads_dir.rglob("*"))
    r = upload(client_a, "big.jsonl", big)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "payload_too_large"
    assert {p for p in api.settings.uploads_dir.rglob("*") if p.is_file()} <= before


def test_upload_malformed_jsonl_names_the_row(api: Api, client_a: httpx.Client) -> None:
    r = upload(client_a, "bad.jsonl", b'{"text": "ok"}\n{"text": "ok"}\n{"text": broken\n')
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["code"] == "invalid_dataset"
    assert "row 3" in err["message"]


def test_upload_unsupported_type_is_422(client_a: httpx.Client) -> None:
    r = upload(client_a, "notes.txt", b"hello\n")
    assert r.status_code == 422
    assert r.json()["error"]["param"] == "file"


def test_upload_filename_path_components_are_dropped(api: Api, client_a: httpx.Client) -> None:
    r = upload(client_a, "../../etc/evil.jsonl", jsonl(TEXT_ROWS))
    assert r.status_code == 201, r.text
    assert r.json()["filename"] == "evil.jsonl"
    stored = list(api.settings.uploads_dir.rglob(f"{r.json()['id']}*"))
    assert len(stored) == 1 and stored[0].is_relative_to(api.settings.uploads_dir)


def test_list_files_newest_first(client_b: httpx.Client) -> None:
    ids = [upload_rows(client_b, TEXT_ROWS) for _ in range(3)]
    page = client_b.get("/v1/files", params={"limit": 2}).json()
    assert [f["id"] for f in page["data"]] == ids[::-1][:2] and page["has_more"] is True
    rest = client_b.get("/v1/files", params={"limit": 2, "after": page["next_cursor"]}).json()
    assert rest["data"][0]["id"] == ids[0]


def test_delete_file_removes_stored_bytes(api: Api, client_a: httpx.Client) -> None:
    file_id = upload_rows(client_a, TEXT_ROWS)
    stored = next(api.settings.uploads_dir.rglob(f"{file_id}*"))
    r = client_a.delete(f"/v1/files/{file_id}")
    assert r.status_code == 200 and r.json() == {"object": "file", "id": file_id, "deleted": True}
    assert not stored.exists()
    assert client_a.get(f"/v1/files/{file_id}").status_code == 404


def test_delete_file_used_by_queued_job_is_409(client_a: httpx.Client) -> None:
    file_id = upload_rows(client_a, TEXT_ROWS)
    assert client_a.post("/v1/jobs", json=job_body(file_id)).status_code == 201
    r = client_a.delete(f"/v1/files/{file_id}")
    assert r.status_code == 409
    assert client_a.get(f"/v1/files/{file_id}").status_code == 200


def test_upload_needs_multipart(client_a: httpx.Client) -> None:
    r = client_a.post("/v1/files", json={"file": "x"})
    assert r.status_code == 422


def test_streamed_upload_without_length_stops_at_the_limit(
    api: Api, client_a: httpx.Client
) -> None:
    def body() -> Iterator[bytes]:
        yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
        for _ in range(100):  # 10 MB if it were all read; the limit is 64 KiB
            yield b'{"text": "' + b"x" * 100_000 + b'"}\n'
        yield b"\r\n--b--\r\n"

    before = {p for p in api.settings.uploads_dir.rglob("*") if p.is_file()}
    r = client_a.post(
        "/v1/files", content=body(), headers={"Content-Type": "multipart/form-data; boundary=b"}
    )
    assert r.status_code == 413
    assert {p for p in api.settings.uploads_dir.rglob("*") if p.is_file()} <= before


def test_upload_json_array_counts_rows_and_columns(client_a: httpx.Client) -> None:
    content = json.dumps([{"text": "a", "label": "x"}, {"text": "b"}, {"text": "c"}]).encode()
    r = upload(client_a, "train.json", content)
    assert r.status_code == 201, r.text
    f = r.json()
    assert (f["format"], f["rows"], f["columns"]) == ("json", 3, ["text", "label"])


def test_upload_json_array_bad_element_names_the_row(client_a: httpx.Client) -> None:
    r = upload(client_a, "train.json", b'[{"text": "a"}, {"text": "b"}, {"text": nope}]')
    assert r.status_code == 422
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_dataset", "file")
    assert err["message"] == "row 3: not valid JSON (Expecting value)"


def test_upload_gzipped_jsonl(api: Api, client_a: httpx.Client) -> None:
    content = gzip.compress(jsonl(TEXT_ROWS))
    r = upload(client_a, "train.jsonl.gz", content)
    assert r.status_code == 201, r.text
    f = r.json()
    assert (f["format"], f["rows"], f["bytes"]) == ("jsonl.gz", len(TEXT_ROWS), len(content))
    assert next(api.settings.uploads_dir.rglob(f"{f['id']}*")).name.endswith(".jsonl.gz")
    assert client_a.post("/v1/jobs", json=job_body(f["id"])).status_code == 201


def test_upload_gzip_bomb_is_refused_naming_the_limit(api: Api, client_a: httpx.Client) -> None:
    # ~20 KiB compressed, under the 64 KiB upload limit; 20 MiB once decompressed.
    bomb = gzip.compress(jsonl(TEXT_ROWS) + b" " * (20 << 20))
    assert len(bomb) < api.settings.max_upload_bytes
    before = {p for p in api.settings.uploads_dir.rglob("*") if p.is_file()}
    r = upload(client_a, "bomb.jsonl.gz", bomb)
    assert r.status_code == 422
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_dataset", "file")
    limit = api.settings.decompressed_limit
    assert f"past the limit of {limit} decompressed bytes" in err["message"]
    assert {p for p in api.settings.uploads_dir.rglob("*") if p.is_file()} <= before


def test_upload_says_the_data_format_it_detected(client_a: httpx.Client) -> None:
    from tests.utils import samples

    r = upload(client_a, "alpaca.jsonl", jsonl([{**row, "source": "demo"} for row in samples.ALPACA]))
    assert r.status_code == 201, r.text
    f = r.json()
    assert f["detected"] == {
        "format": "alpaca", "layout": "alpaca",
        "columns_used": {"prompt": "instruction", "query": "input", "response": "output"},
        "columns_ignored": ["source"],
        "message": None, "near_misses": None, "candidates": None,
    }
    assert client_a.get(f"/v1/files/{f['id']}").json()["detected"] == f["detected"]


def test_upload_of_no_known_format_says_what_came_close(client_a: httpx.Client) -> None:
    r = upload(client_a, "qa.csv", b"question,answer,output\nq,a,o\n")
    assert r.status_code == 201, r.text
    d = r.json()["detected"]
    assert (d["format"], d["layout"]) == (None, None)
    assert d["message"].startswith("no data format matches the columns found (question, "
                                   "answer, output); closest: alpaca (missing 'instruction')")
    assert d["near_misses"][0] == {"layout": "alpaca", "format": "alpaca",
                                   "missing": ["instruction"]}


def test_upload_whose_columns_fit_two_formats_names_both(client_a: httpx.Client) -> None:
    r = upload(client_a, "both.jsonl", jsonl([
        {"text": "a", "messages": [{"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "yo"}]}]))
    assert r.status_code == 201, r.text
    d = r.json()["detected"]
    assert d["format"] is None and sorted(d["candidates"]) == ["openai_chat", "text"]


def test_upload_parquet_is_detected_from_its_first_rows(client_a: httpx.Client) -> None:
    buf = io.BytesIO()
    pq.write_table(pa.table({"input": ["a", "b"], "target": ["w", "x"]}), buf)
    f = upload(client_a, "d.parquet", buf.getvalue()).json()
    assert (f["detected"]["format"], f["detected"]["columns_used"]) == (
        "seq2seq", {"input": "input", "target": "target"})
