# syntax=docker/dockerfile:1
# Sidequest as an image: `sidequest serve` (API + worker in one process), see docs/operations.md.
#   docker build -t sidequest .
#   docker run --init -p 8080:8080 -e SIDEQUEST_API_TOKENS=acme:change-me \
#     -e SIDEQUEST_DATABASE_URL=postgresql://user:pass@db:5432/sidequest sidequest
# Binding 0.0.0.0 needs SIDEQUEST_API_TOKENS: without tokens `serve` refuses to start (exit 2).
# Without SIDEQUEST_DATABASE_URL it runs the embedded PostgreSQL under /var/lib/sidequest (mount a
# volume there to keep the data).

ARG PYTHON_VERSION=3.11

# ---------------------------------------------------------------------------------- builder
# Installs the package and its dependencies into /opt/venv. The compilers are here only for a
# dependency without a wheel for the target platform; none of them reaches the final image.
FROM python:${PYTHON_VERSION}-slim AS builder
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md alembic.ini ./
COPY migrations ./migrations
COPY service ./service
# A regular (non-editable) install: the code goes to site-packages and the Alembic scripts to
# /opt/venv/share/sidequest (pyproject's data-files), so /src can be left behind.
RUN pip install . \
    && sidequest --help > /dev/null \
    && test -f /opt/venv/share/sidequest/alembic.ini \
    && python -c "from service.store import queries; assert queries.definitions() and queries.named()"

# ---------------------------------------------------------------------------------- runtime
FROM python:${PYTHON_VERSION}-slim AS runtime
# The same base image as the builder, so the venv's interpreter path (/usr/local/bin/python3) holds.
RUN groupadd --system sidequest \
    && useradd --system --gid sidequest --home-dir /var/lib/sidequest --create-home \
       --shell /usr/sbin/nologin sidequest
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SIDEQUEST_DATA_DIR=/var/lib/sidequest
USER sidequest
WORKDIR /var/lib/sidequest
EXPOSE 8080
# Liveness: the process answers. Readiness (database reachable, schema at head) is GET /readyz, for
# the orchestrator's own readiness probe.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4).status != 200)"]
ENTRYPOINT ["sidequest"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8080"]
