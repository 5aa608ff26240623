"""Mutation check of the issue-50 plugins (demo, sparseloco, desloc, muon): each mutant changes
one defining line (a β, a sign, a chunk rule, ...) in a temporary copy of the tree (never in
the checkout), runs that plugin's test file there, and counts it killed when a test fails.

    python benchmarks/mutants.py [--only demo] [--timeout 600]

Prints a markdown table, one row per mutant: killed (with the failing tests' count) or
SURVIVED. The unmutated copy runs first and must pass, or the table would mean nothing.
Each mutant's `old` text must occur exactly once in its file.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO, SPARSELOCO = "plugins/aggregators/demo.py", "plugins/aggregators/sparseloco.py"
DESLOC, MUON = "plugins/aggregators/desloc.py", "plugins/optimizers.py"
TESTS = {"demo": "tests/test_demo.py", "sparseloco": "tests/test_sparseloco.py",
         "desloc": "tests/test_desloc.py", "muon": "tests/test_muon.py"}

# (plugin, mutant, file, [(old, new), ...])
MUTANTS = [
    ("demo", "β dropped: δ ← δ + lr·g", DEMO,
     [("delta.mul_(o.decay).add_(gradient, alpha=lr)", "delta.add_(gradient, alpha=lr)")]),
    ("demo", "lr·g → g: δ ← βδ + g", DEMO,
     [("delta.mul_(o.decay).add_(gradient, alpha=lr)", "delta.mul_(o.decay).add_(gradient)")]),
    ("demo", "no sign: x ← x − lr·IDCT(Q)", DEMO,
     [("update = codec.decode(mean).sign()", "update = codec.decode(mean)")]),
    ("demo", "what is sent not subtracted from δ", DEMO,
     [("delta.sub_(codec.decode(scatter_mean(coefficients, [where], [kept])))", "pass")]),
    ("demo", "mean over the choosers → sum", DEMO,
     [('reduce="mean", include_self=False', 'reduce="sum", include_self=False')]),
    ("demo", "divisor rule: largest divisor below chunk, not up to it", DEMO,
     [("range(1, min(length, target) + 1)", "range(1, min(length, target))")]),
    ("demo", "DCT not orthonormal: row 0 not divided by √2", DEMO,
     [("matrix[0] /= math.sqrt(2)", "pass")]),
    ("demo", "weight decay after the sign step, not before", DEMO,
     [("param.mul_(1 - lr * o.weight_decay)", "pass"),
      ("    def after_step(self, step):\n",
       "    @torch.no_grad()\n    def after_step(self, step):\n"
       "        for p, lr in zip(self.params, self.rates()):\n"
       "            p.mul_(1 - lr * self.options.weight_decay)\n")]),
    ("demo", "a rollback (or resume) restores no δ", DEMO,
     [("            delta.copy_(saved)", "            pass")]),
    ("sparseloco", "β dropped: e ← e + Δ", SPARSELOCO,
     [("error.mul_(o.decay).add_(delta)", "error.add_(delta)")]),
    ("sparseloco", "what is sent not subtracted from e", SPARSELOCO,
     [("error.sub_(codec.decode(sent))", "pass")]),
    ("sparseloco", "sum of the messages, not /n", SPARSELOCO,
     [("codec.decode(total / self.ctx.world_size)", "codec.decode(total)")]),
    ("sparseloco", "quantizer range 6σ → 4σ", SPARSELOCO,
     [("RANGE_IN_SIGMAS = 6.0", "RANGE_IN_SIGMAS = 4.0")]),
    ("sparseloco", "outer α ignored (lr 1)", SPARSELOCO,
     [('{"name": "sgd", "lr": self.options.outer_lr}', '{"name": "sgd", "lr": 1.0}')]),
    ("desloc", "K_u default 3·K_x → 2·K_x", DESLOC,
     [("options.first_moment_period or 3 * options.period",
       "options.first_moment_period or 2 * options.period")]),
    ("desloc", "u and v periods swapped", DESLOC,
     [("(o.first_moment_period, o.second_moment_period)",
       "(o.second_moment_period, o.first_moment_period)")]),
    ("desloc", "K_x counted from step, not n = step + 1", DESLOC,
     [("if n % o.period == 0:", "if step % o.period == 0:")]),
    ("muon", "momentum μ → 1 − μ", MUON,
     [("muon=dict(lr=o.lr, momentum=o.momentum,", "muon=dict(lr=o.lr, momentum=1 - o.momentum,")]),
    ("muon", "matrix split: the output layer (adamw_last) left on Muon", MUON,
     [("matrices[:o.adamw_first] + last", "matrices[:o.adamw_first]")]),
    ("muon", "matrix split: embeddings (adamw_first) left on Muon", MUON,
     [("matrices[:o.adamw_first] + last", "last")]),
]


def mutate(text: str, replacements: list[tuple[str, str]], name: str) -> str:
    for old, new in replacements:
        if text.count(old) != 1:
            sys.exit(f"mutant {name!r}: {old!r} occurs {text.count(old)} times, expected once")
        start = text.index(old)
        if new == "pass":  # a whole statement dropped: keep the line's indentation
            line_start = text.rindex("\n", 0, start) + 1
            if text[line_start:start].strip():
                sys.exit(f"mutant {name!r}: {old!r} does not start its line")
        text = text.replace(old, new, 1)
    return text


def run_tests(tree: Path, test_file: str, timeout: float) -> tuple[int, str]:
    """pytest's exit code on `test_file` in `tree`, and its summary line."""
    env = {**os.environ, "PYTHONPATH": str(tree)}  # the copy's packages, in workers too
    try:
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                 test_file], cwd=tree, env=env, capture_output=True, text=True,
                                timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout:.0f} s"
    lines = [line for line in result.stdout.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    return result.returncode, (lines[-1].strip("= ") if lines else result.stdout[-300:])


def copy_tree() -> Path:
    tree = Path(tempfile.mkdtemp(prefix="dsgd-mutants-")) / "tree"
    def ignore(directory: str, names: list[str]) -> set[str]:
        """Not the environment, history or caches; numba's compiled kernels (in
        numba_kernels/__pycache__) are kept, or every test run would compile them again."""
        kept = "numba_kernels" in Path(directory).parts
        return {name for name in names if name in (".venv", ".git", ".hypothesis", ".pytest_cache")
                or name.endswith(".db") or (name == "__pycache__" and not kept)}

    shutil.copytree(ROOT, tree, ignore=ignore)
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=sorted(TESTS))
    parser.add_argument("--timeout", type=float, default=600, help="seconds per test file run")
    args = parser.parse_args()
    plugins = args.only or list(TESTS)
    tree = copy_tree()
    check = subprocess.run([sys.executable, "-c", "import plugins; print(plugins.__file__)"],
                           cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                           capture_output=True, text=True)
    if not check.stdout.startswith(str(tree)):
        sys.exit(f"the copy's plugins are not the ones imported: {check.stdout}{check.stderr}")
    try:
        for plugin in plugins:
            code, summary = run_tests(tree, TESTS[plugin], args.timeout)
            if code != 0:
                sys.exit(f"{TESTS[plugin]} fails without a mutant ({summary}): no table")
            print(f"{plugin}: unmutated {summary}", flush=True)
        rows, killed = [], 0
        for plugin, name, path, replacements in MUTANTS:
            if plugin not in plugins:
                continue
            original = (tree / path).read_text()
            (tree / path).write_text(mutate(original, replacements, name))
            try:
                code, summary = run_tests(tree, TESTS[plugin], args.timeout)
            finally:
                (tree / path).write_text(original)
            verdict = f"killed ({summary})" if code != 0 else f"**SURVIVED** ({summary})"
            killed += code != 0
            rows.append(f"| {plugin} | {name} | {verdict} |")
            print(rows[-1], flush=True)
        print("\n| plugin | mutant | its test file (tests/test_PLUGIN.py) |\n|---|---|---|")
        print("\n".join(rows))
        print(f"\n{killed} of {len(rows)} mutants killed")
    finally:
        shutil.rmtree(tree.parent)


if __name__ == "__main__":
    main()
