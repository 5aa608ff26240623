"""DiLoCo's claim on the Transformer LM task: final perplexity and bytes against allreduce.

Douillard et al. (2023) report that DiLoCo on 8 workers "performs as well as fully synchronous
optimization while communicating 500 times less". This runs `text_lm` (a character-level
Transformer on any UTF-8 text, `--text`) with AdamW in every run: `allreduce`, `diloco` at
each H of `--periods` (the paper's outer SGD, lr 0.7, Nesterov momentum 0.9) and
`streaming_diloco` at the same H with `--fragments` F and delay 1, all in one `dsgd run`.
Per run, from the recorded metrics:

* final test perplexity, and its ratio to allreduce's;
* total bytes sent per worker, and allreduce's over it (how many times less);
* peak bytes sent in one step by one worker (log_interval 1): streaming's should be about
  1/F of diloco's at the same H.

    python benchmarks/diloco.py --text tinyshakespeare.txt [--workers 8] [--steps 600]
        [--periods 10,50,100] [--fragments 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from dsgd_cli.results.reader import Results
from results_row import print_rows

SPEC = """
defaults:
  task: {{name: text_lm, path: {text}, level: char, layers: 2, width: 64, heads: 4, context: 64}}
  workers: {workers}
  epochs: 1
  steps_per_epoch: {steps}
  batch_size: 16
  seed: 0
  optimizer: {{name: adamw, lr: 0.003, weight_decay: 0.1}}
  log_interval: 1
experiments:
  - name: allreduce
    aggregator: {{name: allreduce}}
{experiments}
"""


def experiments(periods: list[int], fragments: int) -> str:
    lines = []
    for period in periods:
        lines.append(f"  - name: diloco-H{period}\n"
                     f"    aggregator: {{name: diloco, period: {period}}}")
        if period % fragments == 0 and period // fragments > 1:
            lines.append(f"  - name: streaming-H{period}\n"
                         f"    aggregator: {{name: streaming_diloco, period: {period}, "
                         f"fragments: {fragments}, delay: 1}}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", required=True, help="a UTF-8 text file (tiny Shakespeare)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=600, help="steps per worker")
    parser.add_argument("--periods", default="10,50,100", help="DiLoCo's H, comma-separated")
    parser.add_argument("--fragments", type=int, default=2, help="Streaming DiLoCo's F")
    args = parser.parse_args()
    periods = [int(p) for p in args.periods.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="dsgd-bench-diloco-"))
    spec = workdir / "diloco.yaml"
    spec.write_text(SPEC.format(text=Path(args.text).resolve(), workers=args.workers,
                                steps=args.steps,
                                experiments=experiments(periods, args.fragments)))
    db = workdir / "r.db"
    result = subprocess.run([sys.executable, "-m", "dsgd_cli", "run", str(spec), "--db", str(db)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"dsgd run failed:\n{result.stderr}")
    store = Results(str(db))
    runs = store.runs()
    rows = {}
    for run in runs:
        finals = {s.name: s.final for s in run.summaries}
        per_step = [m.value for m in store.metric_history(run.id, "bytes_sent")]
        rows[run.experiment] = (finals.get("test_perplexity"), finals.get("total_bytes_sent"),
                                max(per_step) if per_step else None)
    base_ppl, base_bytes, _ = rows["allreduce"]
    print(f"text_lm (2 layers, width 64), {args.workers} workers, {args.steps} steps, AdamW "
          f"(lr 0.003, wd 0.1), batch 16 per worker\n")
    print(f"{'run':<16} {'test ppl':>9} {'ppl/AR':>7} {'bytes/worker':>14} {'AR/bytes':>9} "
          f"{'peak bytes/step':>16}")
    for name, (ppl, sent, peak) in rows.items():
        print(f"{name:<16} {ppl:>9.3f} {ppl / base_ppl:>7.3f} {sent:>14,.0f} "
              f"{base_bytes / sent if sent else float('inf'):>9.1f} {peak:>16,.0f}")
    print_rows((f"DiLoCo ({args.workers} workers, {args.steps} steps): test perplexity, MB sent "
                "per worker, peak kB in a step",
                "; ".join(f"{name} {ppl:.1f}, {sent / 1e6:.1f} MB, peak {peak / 1e3:.0f} kB"
                          for name, (ppl, sent, peak) in rows.items())))


if __name__ == "__main__":
    main()
