"""Scripted fake model servers on 127.0.0.1, standard library only: for driving the real agent
CLIs offline (the tests, the benchmarks and `prompt-broker demo --harness claude_code|codex`).

- `workers.demo.fakes.anthropic`: the Anthropic Messages API, for Claude Code.
- `workers.demo.fakes.responses`: the OpenAI Responses API, for Codex.
"""
