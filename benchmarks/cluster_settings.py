"""Two published cluster settings, reproduced qualitatively on the emulated cluster.

* `sgp`: Assran et al., "Stochastic Gradient Push for Distributed Deep Learning" (ICML 2019):
  nodes of GPUs on a fast intra-node link, 10 Gbit Ethernet against 100 Gbit InfiniBand
  between nodes. Their finding: SGP's throughput gain over all-reduce is large on Ethernet,
  small on InfiniBand, and grows with the node count. Here: `allreduce` and `sgp`, nodes of
  `--per-node` workers, at each of `--nodes`, on both networks.
* `compression`: Agarwal et al., "On the Utility of Gradient Compression in Distributed
  Training Systems" (MLSys 2022): a ResNet-50-sized model on 8 nodes; at 100 Gbit/s the
  overlapped all-reduce is compute-bound and no compressor speeds a step up, at 10 Gbit/s a
  compressor does. Here: `allreduce` without and with `fp16` over a sweep of bandwidths.

The model is the `synthetic` task's MLP of `--params` real parameters: the bytes on the wire
are real. The modeled step time is that of a V100 on ResNet-50 (0.1 s for 25.6 M parameters,
a batch of 32) scaled by `--params / 25.6M`, so that a smaller model keeps the ratio of bytes
to compute seconds (only the latency is not scaled). Each run is a few steps; this machine
cannot compute the steps in their modeled time unless `--time-scale` stretches it, and each
run's `overrun_steps` says how often it could not.

    python benchmarks/cluster_settings.py sgp [--nodes 2 4] [--per-node 4] [--params 6.4M]
    python benchmarks/cluster_settings.py compression [--bandwidths 100 25 10] [--params 25.6M]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsgd_cli.results.reader import Results
from plugins.tasks.synthetic import parse_count
from results_row import print_rows as results_rows

RESNET50_PARAMS = 25_600_000
V100_RESNET50_STEP_S = 0.1  # forward and backward of a batch of 32 on one V100

SPEC = """
defaults:
  task: {{name: synthetic, params: {params}}}
  batch_size: 32
  steps_per_epoch: {steps}
  log_interval: {steps}
  epochs: 1
  optimizer: {{name: sgd, lr: 0.01}}
  compute: {{step_seconds: {step_seconds:.6g}, time_scale: {time_scale:g}}}
experiments:
{experiments}
"""

# SGP paper: 8 GPUs per node on NVLink; between nodes 10 GbE or 100 Gbit InfiniBand.
SGP_NETWORKS = {"ethernet": "{bandwidth: 10Gbit, latency: 50us}",
                "infiniband": "{bandwidth: 100Gbit, latency: 2us}"}
INTRA_NODE = "{bandwidth: 150GB/s, latency: 2us}"  # NVLink 2, per direction


def step_seconds(params: int) -> float:
    """A V100's ResNet-50 step, scaled to `params` parameters."""
    return V100_RESNET50_STEP_S * params / RESNET50_PARAMS


def sgp_experiments(args) -> str:
    lines = []
    for nodes in args.nodes:
        for network, link in SGP_NETWORKS.items():
            for aggregator in ("allreduce", "sgp"):
                lines.append(
                    f"  - name: sgp-{nodes}x{args.per_node}-{network}-{aggregator}\n"
                    f"    workers: {nodes * args.per_node}\n"
                    f"    aggregator: {{name: {aggregator}}}\n"
                    f"    cluster: {{nodes: {nodes}, links: {{intra_node: {INTRA_NODE}, "
                    f"inter_node: {link}}}}}")
    return "\n".join(lines)


def compression_experiments(args) -> str:
    lines = []
    for gbit in args.bandwidths:
        for compressor in ("none", "fp16"):
            lines.append(
                f"  - name: compression-{gbit:g}gbit-{compressor}\n"
                f"    workers: 8\n"
                f"    aggregator: {{name: allreduce, compressor: {{name: {compressor}}}}}\n"
                f"    network: {{bandwidth: {gbit:g}Gbit, latency: 10us}}")
    return "\n".join(lines)


def run(spec_text: str, workdir: Path) -> Results:
    spec = workdir / "spec.yaml"
    spec.write_text(spec_text)
    db = workdir / "r.db"
    result = subprocess.run([sys.executable, "-m", "dsgd_cli", "run", str(spec), "--db", str(db)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"dsgd run failed:\n{result.stdout}\n{result.stderr}")
    return Results(str(db))


def measured(store: Results) -> dict[str, dict]:
    """Per experiment: modeled samples per second, the mean modeled step time, the share of
    overrun steps and the run's real seconds on this machine."""
    rows = {}
    for run in store.runs():
        finals = {s.name: s.final for s in run.summaries}
        steps = [m.value for m in store.metric_history(run.id, "step_seconds")]
        rows[run.experiment] = {
            "samples_per_second": finals["samples_per_second"],
            "step_seconds": sum(steps) / len(steps),
            "overrun_steps": finals.get("overrun_steps", 0.0),
            "total_bytes_sent_inter_node": finals.get("total_bytes_sent_inter_node"),
            "real_seconds": (run.ended_at - run.started_at).total_seconds()}
    return rows


def print_rows(rows: dict[str, dict]) -> None:
    print(f"{'experiment':40} {'samples/s':>10} {'step s':>8} {'overrun':>8} {'real s':>7}")
    for name, row in rows.items():
        print(f"{name:40} {row['samples_per_second']:10.1f} {row['step_seconds']:8.4f} "
              f"{row['overrun_steps']:8.2f} {row['real_seconds']:7.0f}")


def report_sgp(rows: dict[str, dict], args) -> tuple[str, str]:
    print("\nSGP's throughput over allreduce's (samples/s ratio):")
    lines = []
    for nodes in args.nodes:
        ratios = []
        for network in SGP_NETWORKS:
            prefix = f"sgp-{nodes}x{args.per_node}-{network}"
            sgp, allreduce = rows[prefix + "-sgp"], rows[prefix + "-allreduce"]
            gain = sgp["samples_per_second"] / allreduce["samples_per_second"]
            ratios.append(f"{network} {gain:.2f}")
        print(f"  {nodes} nodes × {args.per_node}: " + ", ".join(ratios))
        lines.append(f"{nodes} nodes × {args.per_node}: " + ", ".join(ratios))
    return ("SGP / allreduce samples/s, Ethernet and InfiniBand (Assran et al.)", "; ".join(lines))


def report_compression(rows: dict[str, dict], args) -> tuple[str, str]:
    print("\nfp16's step speed-up over uncompressed allreduce (step time ratio):")
    speedups = []
    for gbit in args.bandwidths:
        none = rows[f"compression-{gbit:g}gbit-none"]["step_seconds"]
        fp16 = rows[f"compression-{gbit:g}gbit-fp16"]["step_seconds"]
        compute = step_seconds(parse_count(args.params))
        print(f"  {gbit:g} Gbit/s: none {none * 1e3:.1f} ms, fp16 {fp16 * 1e3:.1f} ms "
              f"(compute {compute * 1e3:.1f} ms): speed-up {none / fp16:.2f}")
        speedups.append(f"{none / fp16:.2f} at {gbit:g} Gbit/s")
    return (f"Does compression pay (Agarwal et al.)? fp16's step speed-up over allreduce, 8 "
            f"workers, {args.params} parameters", ", ".join(speedups))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("setting", choices=["sgp", "compression"])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--per-node", type=int, default=4)
    parser.add_argument("--bandwidths", type=float, nargs="+", default=[100, 25, 10],
                        help="Gbit/s between the 8 nodes (compression)")
    parser.add_argument("--params", default=None,
                        help="the model's parameters (default: 6.4M for sgp, 25.6M for "
                             "compression)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--time-scale", type=float, default=50.0)
    args = parser.parse_args()
    args.params = args.params or ("6.4M" if args.setting == "sgp" else "25.6M")
    params = parse_count(args.params)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"(on {os.cpu_count()} cores, shared)")
    experiments = (sgp_experiments if args.setting == "sgp" else compression_experiments)(args)
    spec = SPEC.format(params=args.params, steps=args.steps, step_seconds=step_seconds(params),
                       time_scale=args.time_scale, experiments=experiments)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dsgd-bench-cluster-") as workdir:
        rows = measured(run(spec, Path(workdir)))
    print(f"{len(rows)} runs in {time.perf_counter() - started:.0f} s real; "
          f"{args.params} parameters, modeled step {step_seconds(params) * 1e3:.1f} ms, "
          f"time scale {args.time_scale:g}, {args.steps} steps each")
    print_rows(rows)
    figure, value = (report_sgp if args.setting == "sgp" else report_compression)(rows, args)
    worst = max(row["overrun_steps"] for row in rows.values())
    results_rows((figure, f"{value}; `overrun_steps` at most {worst:.1%}"))


if __name__ == "__main__":
    main()
