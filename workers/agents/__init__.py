"""The agents: the harness interface, the scripted agent, Claude Code, Codex, the guarded policy
and one-shot grants.

May import `broker` only (never `workers.runtime` or `workers.demo`).
"""
