#!/usr/bin/env bash
# A Ray cluster of three hosts on this machine, from Linux network namespaces (root, iproute2):
#   sudo bash scripts/netns_cluster.sh up     # 10.77.0.1 Ray head, .2 and .3 workers ({"rollout_host": 4})
#   sudo bash scripts/netns_cluster.sh down   # kills every process of its namespaces, deletes them
# `up` prints the namespaces, the head address and the Ray token; run the driver in the head's namespace:
#   sudo ip netns exec rxn1 env RAY_AUTH_MODE=token RAY_AUTH_TOKEN=<token> relax-agent train CONFIG \
#     runtime=ray data.ray_address=10.77.0.1:6379 'runtime.rollout_resources={"rollout_host": 1}' \
#     'runtime.trainer_resources={"head_host": 0.01}'
# Options after the action: --hosts N --num-cpus N --subnet A.B.C --prefix P --state FILE.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
exec "$PYTHON" -m tests.e2e.netns_cluster "$@"
