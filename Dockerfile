# One image for the API and the GPU workers. The worker needs the CUDA build of torch:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 FTUNE_DATA_DIR=/data

# bubblewrap: the python graders' sandbox (core/graders/sandbox.py), which the API and the
# worker start as the unprivileged ftune user, inside user namespaces (docs/sandbox.md).
RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 1000 ftune
WORKDIR /app
COPY pyproject.toml constraints.txt README.md alembic.ini ./
COPY core core
COPY api api
COPY worker worker
COPY cli cli
COPY client client
COPY migrations migrations
# torch first from the chosen index (CPU or CUDA), then the rest pinned by constraints.txt.
RUN pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0 \
 && grep -v '^torch==' constraints.txt > /tmp/constraints.txt \
 && pip install -c /tmp/constraints.txt '.[tracking]'
RUN mkdir -p /data && chown ftune /data
USER ftune
EXPOSE 8000
CMD ["ftune", "api", "--host", "0.0.0.0", "--port", "8000"]
