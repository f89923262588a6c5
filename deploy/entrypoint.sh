#!/bin/sh
# The image's start: our C++ kernels built for the CPU this container runs on (once: into the cache volume),
# then tinyserve as PID 1 (exec: it gets SIGTERM itself), its API key read from a secret file.
#
# Why at start and not in `docker build`: the kernels are compiled with -march=native (layers/kernels/cpu_kernels.py),
# and an image built on one CPU runs on others, where such a kernel can die of SIGILL. The cache folder is
# named by the CPU's model and flags, so a volume shared by machines of different CPUs keeps one build each.
# No key file (TINYSERVE_API_KEY_FILE, default the secret /run/secrets/tinyserve_api_key), or an empty
# one: tinyserve refuses to start and says so; the image listens on every address and never without a key.
set -eu
cpu_id=$(awk '/^$/ {exit} /^(model name|flags|Features|CPU implementer|CPU part)/' /proc/cpuinfo | sha256sum | cut -c1-16)
export TORCH_EXTENSIONS_DIR="${TINYSERVE_KERNEL_CACHE:-/cache}/torch_extensions/cpu-$cpu_id"
if ! python -m tinyserve.layers.kernels.cpu_kernels; then
    echo "tinyserve: the C++ kernels could not be built here; serving on torch ops (slower)" >&2
fi
exec tinyserve serve --host 0.0.0.0 --port 8000 --api-key-file "${TINYSERVE_API_KEY_FILE:-/run/secrets/tinyserve_api_key}" "$@"
