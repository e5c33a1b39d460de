"""The serving supervisor's restart budget (worker/serve/supervisor.py), with an "engine"
whose interpreter exits at once: a real process that dies at every start, as vLLM does on a
model it cannot load (the real engine's restart is tests/e2e/test_serving.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.db.session import session_scope
from core.infra.settings import Settings, get_settings, reset_settings_cache
from core.serving.tables import Deployment, DeploymentState
from testkit.wait import wait_until
from worker.serve.supervisor import Supervisor


@pytest.fixture
def dying_engine(settings_env: Settings, tmp_path: Path,
                 monkeypatch: pytest.MonkeyPatch) -> Settings:
    venv = tmp_path / "engine"
    (venv / "lib" / "python3.11" / "site-packages" / "vllm").mkdir(parents=True)
    (venv / "lib" / "python3.11" / "site-packages" / "vllm" / "__init__.py").touch()
    (venv / "bin").mkdir()
    (venv / "bin" / "python").write_text("#!/bin/sh\necho 'cannot load the model' >&2\nexit 3\n")
    (venv / "bin" / "python").chmod(0o755)
    monkeypatch.setenv("FTUNE_ENGINE_VENV", str(venv))
    monkeypatch.setenv("FTUNE_SERVING_RESTART_BUDGET", "2")
    reset_settings_cache()
    return get_settings()


def test_an_engine_that_keeps_dying_fails_its_deployment_after_the_budget(
        dying_engine: Settings) -> None:
    with session_scope() as s:
        s.add(Deployment(id="dep-1", key="base:x", kind="base", location="/models/x"))
        s.commit()
    sup = Supervisor(dying_engine, "w-test")

    def state() -> tuple[str, int, int, str | None]:
        sup.step()
        with session_scope() as s:
            dep = s.get(Deployment, "dep-1")
            assert dep is not None
            return dep.state, dep.generation, dep.restarts, dep.error

    final = wait_until(lambda: (st := state())[0] == DeploymentState.failed and st,
                       timeout=60, what="the deployment failed", every=0.1)
    assert final[1:3] == (3, 2)  # started three times: the first and two restarts
    assert final[3] is not None and "exited with 3" in final[3]
    log = dying_engine.data_dir / "serving" / "dep-1" / "engine.log"
    assert str(log) in final[3] and "cannot load the model" in log.read_text()
    assert sup.engines == {}
