# One image for every process of a fleet: replicas (`prompt-broker worker`), the audit worker
# (`prompt-broker audit`), the HTTP server (`prompt-broker serve`) and the CLI. It runs the real
# agents: the Codex CLI at the version package-lock.json pins, and the `claude` extra (the
# Claude Agent SDK, which bundles the Claude Code CLI). See docker-compose.yml and deploy/k8s/.

# The Codex CLI, installed exactly as the lock file says. Its platform package holds a static
# native binary, so the final image needs no Node.js.
FROM node:22-bookworm-slim AS agents
WORKDIR /agents
COPY package.json package-lock.json ./
RUN npm ci --omit=dev --no-audit --no-fund \
    && native="$(ls node_modules/@openai/codex-*/vendor/*/bin/codex | head -n 1)" \
    && test -x "$native" \
    && mkdir -p out && cp "$native" out/codex \
    && out/codex --version

FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY broker ./broker
COPY workers ./workers
COPY web ./web
RUN pip install --no-cache-dir ".[claude]"
COPY --from=agents /agents/out/codex /usr/local/bin/codex
# A non-root user: agents run commands in their work folders, never as root.
RUN useradd --create-home --uid 10001 --user-group broker \
    && mkdir -p /work && chown broker:broker /work
USER broker
ENV PYTHONUNBUFFERED=1 \
    CODEX_BIN=/usr/local/bin/codex \
    PROMPT_BROKER_OPS_PORT=9464
# /metrics, /livez, /readyz of the replica or audit worker (`prompt-broker serve` has its own port).
EXPOSE 9464
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["prompt-broker", "health", "worker"]
# Replicas run until SIGTERM: they park held waits and release their threads, never cancel.
STOPSIGNAL SIGTERM
ENTRYPOINT ["prompt-broker"]
CMD ["worker"]
