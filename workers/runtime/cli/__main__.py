"""`python -m workers.runtime.cli`: the `prompt-broker` command, as a fleet starts its processes."""

from workers.runtime.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
