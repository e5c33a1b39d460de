"""`ftune doctor`: one screen of what this machine's ftune would run with, and what is wrong.

Each check is quick and bounded (a couple of seconds at most: the hub gets one DNS lookup
and one connect, the database and broker one connection each) and says, when it fails,
what to change.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from core.infra.logging import redact
from core.infra.settings import Settings

TIMEOUT_SECONDS = 2.0
# Variables that are not ftune's own but change what it does.
OTHER_VARS = ("DATABASE_URL", "BROKER_URL", "HF_ENDPOINT", "HF_HUB_OFFLINE", "HF_HOME",
              "HF_HUB_CACHE", "CUDA_VISIBLE_DEVICES")
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def masked_url(url: str) -> str:
    """A URL without its password."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(unparseable URL)"
    if parts.password:
        host = parts.hostname or ""
        netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def operator_settings(environ: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """Every variable the operator set that ftune reads, secrets masked."""
    env = dict(os.environ if environ is None else environ)
    names = sorted(k for k in env if k.startswith("FTUNE_") or k in OTHER_VARS)
    out = []
    for name in names:
        value = env[name]
        if any(w in name for w in SECRET_WORDS):
            value = "(set, not shown)"
        elif "://" in value:
            value = masked_url(value)
        out.append((name, redact(value)))
    return out


def roots_check(settings: Settings) -> list[Check]:
    out = []
    for what, roots, var in (("model directories", settings.allowed_model_roots,
                              "FTUNE_ALLOWED_MODEL_ROOTS"),
                             ("dataset paths", settings.allowed_data_roots,
                              "FTUNE_ALLOWED_DATA_ROOTS")):
        if roots:
            missing = [str(r) for r in roots if not r.is_dir()]
            detail = ", ".join(map(str, roots))
            fix = f"create {', '.join(missing)} or fix {var}" if missing else ""
            out.append(Check(what, not missing, f"under {detail}", fix))
        else:
            out.append(Check(
                what, True,
                f"{var} is not set: `ftune up` accepts any local path; `ftune api` and "
                f"`ftune worker` refuse paths",
                f"to use paths with `ftune api`/`ftune worker`: {var}=/dir1:/dir2",
            ))
    return out


def hub_check(settings: Settings) -> Check:
    from core.infra import hub

    if not settings.allow_hub_models:
        return Check("model hub", True, "hub ids are refused (FTUNE_ALLOW_HUB_MODELS=false)")
    if hub.offline_by_setting():
        return Check("model hub", True, "HF_HUB_OFFLINE=1: only models already in the hub "
                     "cache are accepted")
    reach = hub.check(TIMEOUT_SECONDS, fresh=True)
    if reach.reachable:
        return Check("model hub", True, f"{reach.endpoint} reachable ({reach.seconds:.1f} s)")
    return Check(
        "model hub", False, f"{reach.endpoint} not reachable: {reach.reason}",
        "use model directories (model.name_or_path: /path), fill the hub cache on a machine "
        "with access (HF_HOME), set HF_HUB_OFFLINE=1 to say so, or open access to the hub",
    )


def hardware_check(settings: Settings) -> Check:
    from worker.upkeep.registry import gpu_list, usable_cpus

    cpus = len(usable_cpus())
    try:
        gpus = gpu_list(settings)
    except Exception as e:  # noqa: BLE001 - a broken CUDA setup is what doctor is for
        return Check("GPUs / CPUs", False, f"{cpus} CPU cores; GPUs could not be listed ({e})",
                     "check the NVIDIA driver (nvidia-smi) and torch's CUDA build")
    if not gpus:
        return Check("GPUs / CPUs", True, f"no GPU seen, {cpus} CPU cores: jobs run on CPU "
                     "(slow, fine for tiny models)")
    names = ", ".join(f"{g['index']}: {g['name']} {g['memory_mb'] // 1024} GiB" for g in gpus)
    return Check("GPUs / CPUs", True, f"{len(gpus)} GPU(s) ({names}), {cpus} CPU cores")


def database_check(settings: Settings) -> Check:
    from sqlalchemy import create_engine, text

    url = str(settings.database_url)
    shown = masked_url(url)
    if url.startswith("sqlite"):
        path = Path(url.split("///", 1)[-1])
        if not path.exists():
            return Check("database", True, f"{shown} (not created yet: `ftune up` or "
                         "`ftune migrate` creates it)")
        engine = create_engine(url)
    else:
        engine = create_engine(url, connect_args={"connect_timeout": int(TIMEOUT_SECONDS)})
    try:
        with engine.connect() as conn:
            version = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    except Exception as e:  # noqa: BLE001 - any failure is the finding
        reason = str(e).splitlines()[0][:200]
        if "alembic_version" in reason:
            return Check("database", False, f"{shown}: no schema", "run `ftune migrate`")
        return Check("database", False, f"{shown}: cannot connect ({reason})",
                     "start the database, or fix DATABASE_URL")
    finally:
        engine.dispose()
    from core.db.migrate import head_revision

    head = head_revision()
    if version != head:
        return Check("database", False, f"{shown}: schema at {version}, this ftune needs {head}",
                     "run `ftune migrate`")
    return Check("database", True, f"{shown} (schema at {version})")


def broker_check(settings: Settings) -> Check:
    url = str(settings.broker_url)
    shown = masked_url(url)
    if url.startswith("filesystem://"):
        folder = settings.broker_dir
        parent = folder if folder.exists() else settings.data_dir
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not os.access(parent, os.W_OK):
            return Check("broker", False, f"{shown} under {folder}: not writable",
                         f"make {parent} writable, or set FTUNE_DATA_DIR")
        return Check("broker", True, f"{shown} (files under {folder}; one machine only)")
    parts = urlsplit(url)
    host, port = parts.hostname or "localhost", parts.port or 6379
    try:
        with socket.create_connection((host, port), timeout=TIMEOUT_SECONDS):
            pass
    except OSError as e:
        return Check("broker", False, f"{shown}: cannot connect ({e})",
                     "start Redis, or fix BROKER_URL")
    return Check("broker", True, f"{shown} reachable")


def api_check(url: str) -> Check:
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/readyz", timeout=TIMEOUT_SECONDS)
    except httpx.HTTPError as e:
        return Check("API", False, f"{url}: not answering ({type(e).__name__})",
                     "start it (`ftune up`, or `ftune api`), or set FTUNE_URL to where it runs")
    except ValueError as e:
        return Check("API", False, f"{url}: not a URL ({e})", "fix FTUNE_URL")
    if r.status_code != 200:
        return Check("API", False, f"{url}: not ready ({r.status_code} {r.text[:120]})",
                     "see the API's log")
    return Check("API", True, f"{url} ready")


def sandbox_check(settings: Settings) -> Check:
    """Python graders: the operator's switch, and one sandbox started for real (a grader
    scored in it), so a kernel or container that forbids user namespaces shows here."""
    from core.graders.sandbox import sandbox_refusal

    refusal = sandbox_refusal()
    user = "root" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    if not settings.python_graders:
        works = "the sandbox works here" if refusal is None else f"the sandbox would not run: {refusal}"
        return Check("python graders", True, f"off (FTUNE_PYTHON_GRADERS=false); {works}")
    if refusal is None:
        return Check("python graders", True, f"on: a sandbox started and graded here (as {user})")
    return Check("python graders", False, f"on (FTUNE_PYTHON_GRADERS=true) but refused: {refusal}",
                 "fix the sandbox as said (docs/sandbox.md), or set FTUNE_PYTHON_GRADERS=false")


def engine_check(settings: Settings) -> Check:
    """Whether this machine's worker can serve models (vLLM, core/serving/engine.py)."""
    from core.infra.serving_settings import ENGINE_MAKE_TARGET
    from core.serving.engine import engine_problem

    problem = engine_problem(settings)
    if problem is not None:
        return Check("inference engine", False, problem,
                     f"`{ENGINE_MAKE_TARGET}` (vLLM's CPU build in a venv of its own), or "
                     "FTUNE_ENGINE_VENV=<a venv with vllm>; until then inference answers 503")
    if settings.serving_slots == 0:
        return Check("inference engine", True, f"installed at {settings.engine_venv}, but "
                     "FTUNE_SERVING_SLOTS=0: this machine's worker serves nothing")
    return Check("inference engine", True, f"vLLM at {settings.engine_venv}: a worker here "
                 f"runs up to {settings.serving_slots} deployment(s)")


def run_checks(settings: Settings, url: str) -> list[Check]:
    return [*roots_check(settings), hub_check(settings), hardware_check(settings),
            engine_check(settings), database_check(settings), broker_check(settings),
            sandbox_check(settings),
            api_check(url)]
