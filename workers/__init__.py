"""The runtime, the agents and the demos that run on the broker library (`broker`).

Subpackages: `workers.runtime` (replicas, fleet, audit worker, CLI), `workers.agents` (harnesses,
the guarded policy, grants), `workers.demo` (demos and fake model servers).
"""
