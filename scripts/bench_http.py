"""mlxpaged serve vs mlx_lm.server over HTTP (same as `mlxpaged bench serve`; same options).

python scripts/bench_http.py --rates 0.25,0.5,1 --num-requests 16 --max-output 32 --plot
python scripts/bench_http.py --tiny --rates 2,8 --repeats 1   # a smoke run on a tiny random model
"""

from mlxpaged.bench.cli import bench

if __name__ == "__main__":
    bench.main(args=["serve", *__import__("sys").argv[1:]], prog_name="bench_http.py")
