"""The demos (`prompt-broker demo`) and the fake model servers they and the tests run against.

May import `broker`, `workers.agents` and `workers.runtime`.
"""
