"""The runtime: replica processes, the local fleet, the audit worker, logs and the CLI.

May import `broker` and `workers.agents`; never `workers.demo`.
"""
