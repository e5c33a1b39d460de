"""Runs this worker's deployments. One thread, one loop every ``serving_poll_seconds``:

1. each engine it started: exited -> restarted within the restart budget, else failed;
   starting -> ready once ``/health`` answers; told to stop, or idle past
   ``serving_idle_seconds`` (unless keep_warm) -> its process tree stopped, row stopped;
2. heart-beat its rows (an API process re-requests a deployment whose worker fell silent);
3. while it has a free serving slot: claim a requested deployment (worker/serve/claim.py:
   on a GPU worker placed on GPUs by the scheduler's rules, core/jobs/serving_plan.py; on a
   CPU worker within ``serving_memory_mb``) and launch its engine on them.

Engines never take a training slot (serving_slots is a budget of its own); on a GPU worker
they hold their GPUs as jobs do (gpu_allocations rows, freed when the deployment stops, and
the workers with queued work rung). They run at the worker's nice value like trainers."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import httpx
from sqlalchemy import update
from sqlalchemy.orm import Session

from core.db.models import utcnow
from core.db.session import execute_rowcount, session_scope
from core.infra.ports import free_port
from core.infra.settings import Settings
from core.serving.engine import SERVED_NAME, engine_argv, engine_env, engine_problem
from core.serving.tables import Deployment, DeploymentState
from worker.run import process_tree
from worker.run.claim import ring_workers_with_work
from worker.serve.claim import claim_deployment, free_gpus

log = logging.getLogger(__name__)
HEALTH_TIMEOUT = 2.0
STOP_GRACE_SECONDS = 10.0


@dataclass
class Engine:
    """An engine process this worker started for a deployment (one generation of it)."""

    deployment_id: str
    generation: int
    url: str
    launched: process_tree.Launched
    gpu_ids: tuple[int, ...] = ()  # the GPUs its deployment holds ((): CPU)
    started: float = field(default_factory=time.monotonic)
    ready: bool = False


@dataclass
class Supervisor:
    settings: Settings
    worker_id: str
    engines: dict[str, Engine] = field(default_factory=dict)
    restarts: dict[str, list[float]] = field(default_factory=dict)
    gpu: bool = False  # the engines run on GPUs (else vLLM's CPU build)

    # ------------------------------------------------------------------ the loop

    def run(self, stop: threading.Event) -> None:
        self.forget_previous()
        while not stop.wait(self.settings.serving_poll_seconds):
            try:
                self.step()
            except Exception:
                log.exception("serving supervisor pass failed")
        self.stop_all()

    def step(self) -> None:
        with session_scope() as s:
            for dep_id in list(self.engines):
                self._watch(s, dep_id)
            self._heartbeat(s)
        if engine_problem(self.settings) is None:
            while len(self.engines) < self.settings.serving_slots and self._claim_one():
                pass

    def forget_previous(self) -> None:
        """Rows an earlier process under this worker id left running: their engines died
        with it (PR_SET_PDEATHSIG)."""
        with session_scope() as s:
            left = list(s.execute(update(Deployment).where(
                Deployment.worker_id == self.worker_id,
                Deployment.state.in_([DeploymentState.starting, DeploymentState.ready,
                                      DeploymentState.stopping]))
                .values(state=DeploymentState.stopped, stopped_at=utcnow(), url=None)
                .returning(Deployment.id)).scalars())
            for dep_id in left:
                free_gpus(s, dep_id)

    # ------------------------------------------------------------------ each engine

    def _watch(self, s: Session, dep_id: str) -> None:
        eng = self.engines[dep_id]
        dep = s.get(Deployment, dep_id, populate_existing=True)
        if dep is None or dep.worker_id != self.worker_id or dep.generation != eng.generation:
            self._stop_engine(eng, "its deployment was taken over or removed")
            free_gpus(s, dep_id, worker_id=self.worker_id)
            s.commit()
            return
        if dep.state == DeploymentState.stopping:
            self._stop_engine(eng, "asked to stop")
            self._set(s, dep, DeploymentState.stopped, stopped_at=utcnow(), url=None)
            return
        if eng.launched.poll() is not None:
            self._died(s, dep, eng)
            return
        if not eng.ready:
            if self._healthy(eng, dep.engine_key):
                eng.ready = True
                # Idle time counts from now: a (re)start is no reason to stop it at once.
                self._set(s, dep, DeploymentState.ready, ready_at=utcnow(),
                          last_used_at=utcnow(), error=None)
                log.info("deployment %s ready at %s after %.1f s", dep.id, eng.url,
                         time.monotonic() - eng.started)
            elif time.monotonic() - eng.started > self.settings.serving_start_timeout_seconds:
                self._stop_engine(eng, "not healthy in time")
                self._died(s, dep, eng, why="did not become healthy within "
                           f"{self.settings.serving_start_timeout_seconds:g} s")
            return
        idle = utcnow() - dep.last_used_at
        if not dep.keep_warm and idle > timedelta(seconds=self.settings.serving_idle_seconds):
            cutoff = utcnow() - timedelta(seconds=self.settings.serving_idle_seconds)
            moved = execute_rowcount(s, update(Deployment).where(
                Deployment.id == dep.id, Deployment.state == DeploymentState.ready,
                Deployment.last_used_at < cutoff).values(state=DeploymentState.stopping))
            s.commit()
            if moved:
                self._stop_engine(eng, f"idle for {idle.total_seconds():.0f} s")
                s.refresh(dep)
                self._set(s, dep, DeploymentState.stopped, stopped_at=utcnow(), url=None)

    def _died(self, s: Session, dep: Deployment, eng: Engine, why: str | None = None) -> None:
        self.engines.pop(dep.id, None)
        why = why or f"the engine exited with {eng.launched.poll()}"
        # Its engine core and workers outlive the API server process that died.
        process_tree.kill_remaining(eng.launched)
        window = self.settings.serving_restart_window_seconds
        now = time.monotonic()
        recent = [t for t in self.restarts.get(dep.id, []) if now - t < window]
        if len(recent) >= self.settings.serving_restart_budget:
            log.error("deployment %s failed: %s (restarted %d times in %g s)", dep.id, why,
                      len(recent), window)
            self._set(s, dep, DeploymentState.failed, error=f"{why}; see {self._log(dep.id)}",
                      stopped_at=utcnow(), url=None)
            return
        self.restarts[dep.id] = [*recent, now]
        log.warning("deployment %s: %s; restarting it", dep.id, why)
        self._launch(s, dep, restarts=dep.restarts + 1, gpu_ids=eng.gpu_ids)

    def _healthy(self, eng: Engine, key: str | None) -> bool:
        """Our engine answers its model list with our key (a port taken meanwhile by another
        server, whose /health may say 200, does not)."""
        try:
            r = httpx.get(f"{eng.url}/v1/models", timeout=HEALTH_TIMEOUT,
                          headers={"Authorization": f"Bearer {key}"})
            return r.status_code == 200 and any(
                m.get("id") == SERVED_NAME for m in r.json().get("data", []))
        except (httpx.HTTPError, ValueError, AttributeError):
            return False

    def _heartbeat(self, s: Session) -> None:
        if self.engines:
            s.execute(update(Deployment).where(Deployment.id.in_(list(self.engines)),
                                               Deployment.worker_id == self.worker_id)
                      .values(heartbeat_at=utcnow()))
            s.commit()

    # ------------------------------------------------------------------ claim and launch

    def _claim_one(self) -> bool:
        claimed = claim_deployment(self.settings, self.worker_id, gpu=self.gpu,
                                   running=list(self.engines))
        if claimed is None:
            return False
        with session_scope() as s:
            dep = s.get(Deployment, claimed.deployment_id)
            assert dep is not None
            self._launch(s, dep, restarts=0, gpu_ids=claimed.gpu_ids)
        return True

    def _launch(self, s: Session, dep: Deployment, *, restarts: int,
                gpu_ids: tuple[int, ...]) -> None:
        port, key = free_port(), "ek-" + secrets.token_urlsafe(24)
        generation = dep.generation + 1
        url = f"http://{self.settings.serving_host}:{port}"
        argv = engine_argv(self.settings, model=dep.location, port=port,
                           lora=dep.kind == "base", gpu=self.gpu,
                           tensor_parallel=max(1, len(gpu_ids)))
        env = engine_env(process_tree.trainer_env(), api_key=key, settings=self.settings,
                         gpu_ids=gpu_ids if self.gpu else None)
        launched = process_tree.spawn(argv, log_path=self._log(dep.id), env=env,
                                      tag=f"serve:{dep.id}:{generation}")
        self.engines[dep.id] = Engine(dep.id, generation, url, launched, gpu_ids)
        self._set(s, dep, DeploymentState.starting, generation=generation, url=url,
                  engine_key=key, pid=launched.pid, started_at=utcnow(), ready_at=None,
                  heartbeat_at=utcnow(), restarts=restarts)
        log.info("deployment %s: engine started (pid %d, %s) for %s", dep.id, launched.pid,
                 url, dep.location)

    def _log(self, dep_id: str) -> Path:
        return self.settings.data_dir / "serving" / dep_id / "engine.log"

    # ------------------------------------------------------------------ stopping

    def _stop_engine(self, eng: Engine, why: str) -> None:
        self.engines.pop(eng.deployment_id, None)
        log.info("deployment %s: stopping its engine (%s)", eng.deployment_id, why)
        process_tree.stop_tree(eng.launched, grace=STOP_GRACE_SECONDS)

    def stop_all(self) -> None:
        """At worker shutdown: every engine stopped, every row said so."""
        for eng in list(self.engines.values()):
            self._stop_engine(eng, "the worker is stopping")
            with session_scope() as s:
                s.execute(update(Deployment).where(
                    Deployment.id == eng.deployment_id, Deployment.worker_id == self.worker_id)
                    .values(state=DeploymentState.stopped, stopped_at=utcnow(), url=None))
                free_gpus(s, eng.deployment_id)

    def _set(self, s: Session, dep: Deployment, state: DeploymentState,
             **values: object) -> None:
        for k, v in values.items():
            setattr(dep, k, v)
        dep.state = state
        freed = free_gpus(s, dep.id) if state in (DeploymentState.stopped,
                                                   DeploymentState.failed) else 0
        s.commit()
        if freed:  # queued jobs may fit now
            ring_workers_with_work(self.settings)


_thread: threading.Thread | None = None
_supervisor: Supervisor | None = None


def start_thread(settings: Settings, worker_id: str, stop: threading.Event) -> None:
    """The worker's serving supervisor (worker/queue/celery_app.py starts it when ready)."""
    global _thread, _supervisor
    if settings.serving_slots == 0 or (_thread is not None and _thread.is_alive()):
        return
    from worker.upkeep.registry import inventory

    _supervisor = Supervisor(settings, worker_id, gpu=bool(inventory(settings).gpus))
    _thread = threading.Thread(target=_supervisor.run, args=(stop,), name="ftune-serving",
                               daemon=True)
    _thread.start()


def stop_engines() -> None:
    """At worker shutdown, whether or not the thread got to see the stop flag."""
    if _supervisor is not None:
        _supervisor.stop_all()
