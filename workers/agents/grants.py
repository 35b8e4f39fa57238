"""One-shot grants and resume texts: pure rules, no Redis.

A parked approval is resumed by telling the agent to re-attempt the call; the re-attempt raises
the same approval again, and a one-shot grant answers it without asking the person twice.
"""

from __future__ import annotations

import os
import re

from broker import Prompt, verdict
from broker.answers import NEGATIVE

__all__ = ["approves", "covers", "resume_text"]

#: Labels that approve beyond `broker.answers.AFFIRMATIVE`: the Codex harness's session-wide
#: option (`workers.agents.codex.SESSION_LABEL`), which only a structured answer can pick. The
#: original worker scored it as a denial on the parked path; we count it as the approval it is.
SESSION_APPROVALS = frozenset({"approve for this session"})


def approves(answers: object) -> bool:
    """An approval verdict that also takes the session-wide option as approval."""
    if verdict(answers) == "approve":
        return True
    first = answers[0] if isinstance(answers, list) and answers else None
    labels = getattr(first, "answer", None)
    label = labels[0] if isinstance(labels, list) and labels else None
    return isinstance(label, str) and " ".join(label.split()).casefold() in SESSION_APPROVALS


_CD_THEN = re.compile(r"cd (?P<path>'[^']*'|\"[^\"]*\"|[^\s;|&'\"]+) && (?P<cmd>.+)", re.S)
_SAFE_PATH = re.compile(r"[A-Za-z0-9._/ -]+")


def covers(granted: str | None, requested: str | None, work_folder: str) -> bool:
    """Does a grant with key `granted` cover a call with key `requested`?

    A keyless grant covers any call to its subject; a keyed grant never covers a keyless call.
    Otherwise exact equality, or one widened shape: the same tool, with the call being
    `cd <dir> && <the granted command>` for a plain `<dir>` inside the work folder.
    """
    if granted is None or granted == requested:
        return True
    if requested is None:
        return False
    tool, sep, stored = granted.partition(":")
    rtool, rsep, command = requested.partition(":")
    if not (sep and rsep and tool == rtool and work_folder):
        return False
    m = _CD_THEN.fullmatch(command)
    return m is not None and m["cmd"] == stored and _inside(m["path"], work_folder)


def _inside(path: str, work_folder: str) -> bool:
    """A plain, quoted-or-not directory that resolves inside the work folder."""
    if path[0] in "'\"":
        path = path[1:-1]
    if not path or path.startswith("-") or not _SAFE_PATH.fullmatch(path):
        return False
    root = os.path.normpath(work_folder)
    resolved = os.path.normpath(os.path.join(root, path))
    return resolved == root or resolved.startswith(root.rstrip(os.sep) + os.sep)


def resume_text(prompt: Prompt, work_folder: str = "") -> str:
    """What a resume turn tells the agent about the answer to its parked prompt."""
    subject = prompt.questions[0].subject if prompt.questions else None
    answers = prompt.answers or []
    if prompt.kind == "approval" and subject:
        if approves(answers):
            text = f"Your request to use `{subject}` was APPROVED by the person. Retry it now."
            if work_folder:
                text += (
                    f" Your shell was reset to the work folder {work_folder}: re-establish any"
                    " working directory and environment first. Re-running the call as"
                    " `cd <dir inside the work folder> && <the exact command>` is covered."
                )
            return text
        text = (
            f"Your request to use `{subject}` was DENIED by the person. Do not retry it;"
            " choose another approach."
        )
        words = (prompt.answer_text or "").strip()
        if words and words.casefold() not in NEGATIVE:
            text += f' Their words: "{words}"'
        return text
    lines = ["The person answered:"]
    for a in answers:
        lines.append(f"- {a.question}: {', '.join(a.answer) or '(no answer)'}")
    return "\n".join(lines)
