"""The command line, with the runtime's commands added to the library's (`broker.cli`).

prompt-broker worker [--id NAME]         one replica, until SIGTERM/SIGINT
prompt-broker audit                      the arq audit worker
prompt-broker up [--workers N] [--data-dir DIR]
                                         a local fleet: N replicas + the audit worker, on its
                                         own Redis (data kept in DIR) unless one is given
prompt-broker demo [--workers N]         a self-driving scenario on a throwaway local fleet
       [--harness scripted|claude_code|codex]   (the real agent CLIs against a fake model)
prompt-broker thread new THREAD [...]    create a thread and its agent session
prompt-broker thread close THREAD        end a thread (its open prompt is cancelled)
prompt-broker thread status THREAD [--json]   who holds it, its lease, what it waits on
prompt-broker serve [--host H] [--port P] [--tokens FILE]
                                         the HTTP API, its event streams and the web inbox
prompt-broker token new NAME --scopes read,answer [--threads GLOB] [--groups G1,G2]
                                         make a token; prints it, then its line for the config
prompt-broker webhooks list [--json]     the subscriptions and the deliveries that failed
prompt-broker webhooks replay DELIVERY_ID
                                         queue a failed delivery again
prompt-broker status [--json]            the fleet: replicas, threads, waits, prompts, audit backlog
prompt-broker health worker|audit|serve [--port P] [--live]
                                         probe a process's health endpoint (exit 0 when ready)
"""

from __future__ import annotations

from collections.abc import Sequence

from broker.cli import COMMANDS, Command
from broker.cli import main as broker_main
from workers.runtime.cli import ops, processes, serve, thread, up

__all__ = ["RUNTIME", "main"]

#: The runtime's commands, by group (each group's module holds its arguments and handlers).
RUNTIME: dict[str, Command] = {
    **processes.COMMANDS,
    **up.COMMANDS,
    **thread.COMMANDS,
    **serve.COMMANDS,
    **ops.COMMANDS,
}


def main(argv: Sequence[str] | None = None) -> int:
    """The `prompt-broker` command: the library's commands and the runtime's."""
    return broker_main(argv, {**COMMANDS, **RUNTIME})
