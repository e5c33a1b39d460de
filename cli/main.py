"""The `ftune` command: run the service (up, api, worker, migrate, create-key) and use it
(submit, status, list, logs, cancel, pause, resume, download, grade, demo)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from cli import estimate, jobs, operator
from cli import evals as eval_cli
from cli.chat import chat as chat_command

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
# In the order `ftune --help` lists them: running the service, using it, estimating a spec.
for module in (operator, jobs, estimate):
    app.registered_commands.extend(module.commands.registered_commands)
app.add_typer(eval_cli.app, name="eval")
app.add_typer(operator.deployments, name="deployments")


@app.command()
def demo(
    data_dir: Annotated[Path, typer.Option(help="Where the demo keeps everything.")] = Path(
        ".ftune-demo"
    ),
    steps: int = 40,
) -> None:
    """Build a tiny model and dataset, run the embedded stack, train, download, load."""
    from cli.demo import run_demo
    from core.infra.logging import quiet_library_loggers, torch_device

    quiet_library_loggers(torch_device())

    run_demo(data_dir, steps=steps)


app.command("chat")(chat_command)


def main() -> None:
    """The `ftune` program. A local `ftune estimate` process does nothing after the
    estimate, so it may skip importing bitsandbytes (most of its time)."""
    args = sys.argv[1:]
    if args[:1] == ["estimate"] and "--server" not in args:
        from core.model.estimate import forget_bitsandbytes

        forget_bitsandbytes()
    app()


if __name__ == "__main__":
    # `python -m cli.main ...` (the embedded stack runs migrate this way).
    main()
