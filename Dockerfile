# One image for every process of a fleet: replicas (`prompt-broker worker`), the audit worker
# (`prompt-broker audit`) and the CLI. See docker-compose.yml.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY broker ./broker
COPY workers ./workers
RUN pip install --no-cache-dir .
ENV PYTHONUNBUFFERED=1
# Replicas run until SIGTERM: they park held waits and release their threads, never cancel.
STOPSIGNAL SIGTERM
ENTRYPOINT ["prompt-broker"]
CMD ["worker"]
