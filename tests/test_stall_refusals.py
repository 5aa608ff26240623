"""Values that validate but could never make progress are refused before anything runs, with
the arithmetic in one line (exit 2, `--dry-run` too): failures faster than steps
(emulation/failures.py) and a model that cannot cross the network within the `timeout`
(spec/transfer_time.py). A modeled transfer that would outlast the timeout all the same ends
the run when it starts, instead of sleeping (comm/communicator.py)."""

from __future__ import annotations

import time

import pytest

from conftest import dsgd, dsgd_in_process, write_spec
from dsgd_cli.comm.communicator import Comm, CommTimeout, Handle
from dsgd_cli.errors import SpecError
from dsgd_cli.results.store import Store
from dsgd_cli.spec.experiments import load_spec

# logreg's model: 10 weights of 4 bytes, 320 bits: 320 s at 1 bit/s.
SPEC = """
    defaults:
      task: {{name: logreg}}
      workers: 4
      epochs: 1
      steps_per_epoch: 2
      timeout: 20
    experiments:
      - name: e
        {keys}
"""


def _spec(tmp_path, keys: str):
    return write_spec(tmp_path, SPEC.format(keys=keys))


def _refusal(spec) -> str:
    """What `dsgd run SPEC --dry-run` refuses it with: its one line."""
    result = dsgd_in_process("run", str(spec), "--dry-run")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    return result.stderr.strip()


def _message(spec) -> str:
    with pytest.raises(SpecError) as error:
        load_spec(spec)
    return str(error.value)


# -- failures faster than steps ---------------------------------------------------------------

def test_mtbf_shorter_than_a_step_is_refused_in_a_dry_run(tmp_path):
    spec = _spec(tmp_path, "failures: {mtbf: 1ms, restart: 0}")
    assert _refusal(spec) == (
        f"dsgd: error: {spec}: experiments[0].failures.mtbf: the job would fail every 250 µs "
        "on average (mtbf 1 ms / 4 workers: any worker's failure restarts every worker), not "
        "longer than one step (10 ms, what a step without a compute model counts as): the run "
        "would be rolled back at nearly every step and never end; raise mtbf")


@pytest.mark.parametrize("aggregator, refused_mtbf, accepted_mtbf", [
    # restart: any of the 4 workers' failures stops the job, every mtbf / 4
    ("allreduce", 0.2, 0.21),
    # continue: each worker on its own, every mtbf
    ("diloco", 0.05, 0.06),
])
def test_mtbf_is_held_to_the_modeled_step(tmp_path, aggregator, refused_mtbf, accepted_mtbf):
    def spec(mtbf):
        return _spec(tmp_path, f"""aggregator: {{name: {aggregator}}}
        compute: {{step_seconds: 0.05}}
        failures: {{mtbf: {mtbf}, restart: 1s}}""")
    message = _message(spec(refused_mtbf))
    assert "experiments[0].failures.mtbf: " in message
    assert "not longer than one step (50 ms, compute.step_seconds)" in message
    load_spec(spec(accepted_mtbf))


def test_fixed_failures_alone_are_not_held_to_the_step(tmp_path):
    load_spec(_spec(tmp_path, "failures: {restart: 0, at: [{node: 0, time: 0}, "
                              "{node: 1, time: 0}]}"))


def test_a_restart_job_that_could_never_outrun_its_rollbacks_is_refused(tmp_path):
    """Failures every 250 ms against 64 steps of 50 ms with no checkpoint: each failure rolls
    the job back to the start, and (e^12.8 - 1) * 250 ms is about a day for 3.2 s of work."""
    spec = write_spec(tmp_path, """
        defaults: {task: {name: logreg}, workers: 4, epochs: 4, steps_per_epoch: 16}
        experiments:
          - {name: e, compute: {step_seconds: 0.05}, failures: {mtbf: 1s, restart: 0}}
    """)
    assert _refusal(spec) == (
        f"dsgd: error: {spec}: experiments[0].failures.mtbf: the job would fail every 250 ms "
        "on average (mtbf 1 s / 4 workers) and each failure rolls it back to the start of "
        "training (no checkpoint_every): 64 steps of at least 50 ms (3.2 s) see 12.8 failures "
        "on average, so getting past them is expected to take 1.05 days, 2.83e+04 times that; "
        "raise mtbf or checkpoint more often")
    # Checkpoints every 8 steps: 3.2 failures expected in 0.4 s, (e^3.2 - 1) * 250 ms = 5.9 s.
    load_spec(write_spec(tmp_path, spec.read_text().replace(
        "restart: 0}", "restart: 0, checkpoint_every: 8}")))


@pytest.mark.parametrize("steps, refused", [(6, False), (7, True)])
def test_the_rollback_refusal_is_the_expected_time_against_a_hundred_times_the_span(
        steps, refused):
    """One failure per second (mtbf 2 s over 2 workers), steps of 1 s, no restart time: the
    span of `steps` seconds takes e^steps - 1 seconds on average, (e^6 - 1) / 6 = 67 times the
    span (accepted), (e^7 - 1) / 7 = 157 times (refused). With a restart of 1 s each failure
    costs 1 s more: (e^6 - 1) * 2 / 6 = 134 times, refused."""
    from dsgd_cli.spec.failures_spec import FailureDomains, check_rollbacks_are_outrun

    def check(restart):
        check_rollbacks_are_outrun(
            {"mtbf": 2.0, "restart": restart, "checkpoint_every": steps}, "failures",
            domains=FailureDomains.of(2, None), step_seconds=1.0, total_steps=100)

    if refused:
        with pytest.raises(SpecError, match=r"see 7 failures on average"):
            check(0.0)
    else:
        check(0.0)
        with pytest.raises(SpecError, match=r"every 6 steps\): 6 steps of at least 1 s"):
            check(1.0)


# -- a model that cannot cross the network in time --------------------------------------------

def _cluster(inter_node: str, extra: str = "") -> str:
    return f"""cluster:
          nodes: 2
          links: {{intra_node: {{bandwidth: 10GB/s, latency: 0}}, inter_node: {inter_node}}}
          {extra}"""


def test_a_1_bit_link_is_refused_in_a_dry_run_with_the_arithmetic(tmp_path):
    spec = _spec(tmp_path, _cluster("{bandwidth: 1, latency: 50us}"))
    assert _refusal(spec) == (
        f"dsgd: error: {spec}: experiments[0].cluster.links.inter_node: sending the model once "
        "(40 B) takes 5.33 min over this link (1 bit/s, latency 50 µs), not less than the "
        "experiment's timeout of 20 s: no step that waits for it would end; raise the "
        "bandwidth or the timeout")


def test_a_model_that_crosses_within_the_timeout_is_accepted(tmp_path):
    load_spec(_spec(tmp_path, _cluster("{bandwidth: 32, latency: 0}")))  # 10 s of 20


def test_the_time_scale_stretches_the_crossing_into_real_time(tmp_path):
    message = _message(_spec(tmp_path, _cluster("{bandwidth: 32, latency: 0}") + """
        compute: {step_seconds: 0.01, time_scale: 4}"""))
    assert "takes 10 s modeled, 40 s in real time (× time_scale 4)" in message


def test_dedicated_network_cards_carry_parts_of_the_model_at_once(tmp_path):
    # 320 bits at 10 bit/s: 32 s through one shared card, 16 s through 2 dedicated ones
    assert "takes 32 s over" in _message(_spec(tmp_path, _cluster("{bandwidth: 10, latency: 0}")))
    load_spec(_spec(tmp_path, _cluster("{bandwidth: 10, latency: 0}", "nic: dedicated")))


def test_regions_are_held_to_their_inter_region_link(tmp_path):
    message = _message(_spec(tmp_path, """cluster:
          nodes: 2
          regions: [1, 1]
          links: {intra_node: {bandwidth: 10GB/s}, inter_region: {bandwidth: 1, latency: 0}}"""))
    assert "experiments[0].cluster.links.inter_region: sending the model once (40 B)" in message


def test_a_network_link_is_held_to_the_same_rule(tmp_path):
    message = _message(_spec(tmp_path, "network: {bandwidth: 1, latency: 0}"))
    assert "experiments[0].network: sending the model once (40 B) takes 5.33 min" in message


def test_with_a_compressor_only_the_latency_is_held_to_the_timeout(tmp_path):
    compressed = "aggregator: {name: allreduce, compressor: {name: topk, ratio: 0.5}}"
    load_spec(_spec(tmp_path, f"""{compressed}
        network: {{bandwidth: 1, latency: 0}}"""))
    message = _message(_spec(tmp_path, f"""{compressed}
        network: {{bandwidth: 1, latency: 30s}}"""))
    assert "one message, its latency alone, takes 30 s over this link" in message


def test_one_worker_sends_nothing(tmp_path):
    load_spec(_spec(tmp_path, "workers: 1\n        network: {bandwidth: 1, latency: 0}"))


# -- a transfer that outlasts the timeout at run time -----------------------------------------

def test_a_modeled_transfer_as_long_as_the_timeout_fails_at_once():
    comm = Comm(0, 1, timeout_s=20.0)  # no process group: the handle's work is already done
    started = time.perf_counter()
    handle = Handle(comm, [None], started, emulated_s=20.0, operation="send to rank 1")
    expected = (r"^send to rank 1: its modeled transfer lasts 20 s of real time, not less "
                r"than the spec's timeout \(20 s\)")
    with pytest.raises(CommTimeout, match=expected):
        handle.wait()
    assert time.perf_counter() - started < 5  # not slept out
    short = Handle(comm, [None], time.perf_counter(), emulated_s=0.05, result="done")
    assert short.wait() == "done"


def test_a_run_the_timeout_would_not_end_fails_naming_the_transfer(tmp_path):
    """Compressed, the check before the run knows only the latency: its first exchange over
    the 1 bit/s link would last minutes; the run fails at once instead of sleeping them (a
    process, so that a run that sleeps fails the test when `dsgd` is stopped)."""
    spec = _spec(tmp_path, """workers: 2
        timeout: 5
        aggregator: {name: allreduce, compressor: {name: topk, ratio: 0.5}}
        network: {bandwidth: 1, latency: 0}""")
    db = tmp_path / "results.db"
    result = dsgd("run", str(spec), "--db", str(db), timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    (run,) = Store(str(db)).runs()
    assert run.status == "failed"
    assert "CommTimeout: " in run.reason
    assert "its modeled transfer lasts" in run.reason and "timeout (5 s)" in run.reason
