"""Coding-agent conversations: mlxpaged serve vs mlx_lm.server, K concurrent chats of T turns with tools.

python scripts/bench_agents.py --ks 1,4,8 --turns 8 --repeats 3 --restart --plot
python scripts/bench_agents.py --tiny --ks 1 --turns 2 --repeats 1   # a smoke run on a tiny random model
"""

import sys

from mlxpaged.bench.agents import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
